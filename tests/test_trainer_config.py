"""`TrainerConfig`'s sections are typed dataclasses written in source; they hold exactly the option
table's fields for their section (config/options.py `Option.to`), in its order, with its types and
defaults, plus the fields that are no option (marked `extra`: what the flags derive, an objective's flag)."""
from dataclasses import MISSING, fields
from typing import List, Optional, get_type_hints

import pytest

from megatron_csbp.config.options import OPTIONS
from megatron_csbp.training import config as trainer_config


def option_type(o):
    """The annotation an option's value has: a switch is a bool; nargs a list; no default Optional."""
    t = bool if o.type is None and isinstance(o.default, bool) else o.type
    t = List[t] if o.nargs else t
    return Optional[t] if o.default is None else t


SECTIONS = {f.name: get_type_hints(trainer_config.TrainerConfig)[f.name]
            for f in fields(trainer_config.TrainerConfig) if f.name != "model"}


@pytest.mark.quick
@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_config_sections_are_the_option_table(section):
    cls = SECTIONS[section]
    hints = get_type_hints(cls)
    declared = [(f.name, hints[f.name], f.default) for f in fields(cls) if not f.metadata.get("extra")]
    table = [(o.name, option_type(o), o.default) for o in OPTIONS if section in o.to]
    assert declared == table
    names = {o.name for o in OPTIONS}
    assert all(f.name not in names or not f.metadata.get("extra") for f in fields(cls))  # extra: no option
    assert all(f.default is not MISSING for f in fields(cls))
