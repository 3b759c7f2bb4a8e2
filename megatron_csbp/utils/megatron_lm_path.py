"""Where Megatron-LM's training package is: one lookup for the tests, `examples/megatron_lm/pretrain_bdlm.py`
and `.ci/run` (docs/megatron-lm.md "Getting Megatron-LM").

Megatron-LM's training package (`megatron.training`, `pretrain_gpt.py`) is on no package registry; it
comes from a tag of a git clone, and the tag must match the installed megatron-core wheel (its
`megatron/core` is that wheel's). The lookup, first hit wins:

1. `MEGATRON_LM_PATH`, when set (a clone, or any directory holding the extracted files);
2. (`pretrain_bdlm.py` only: `cwd=True`) the current directory, when it is a checkout;
3. the cache `~/.cache/megatron-csbp/megatron-lm-<tag>` of the installed megatron-core's tag
   (`tag_for`: megatron-core 0.16.x runs with tag core_v0.16.1, 0.19.x with core_v0.19.0: Megatron-LM
   has no core_v0.19.2 tag).

When nothing is found, `missing_message()` is the one line that says how to get it (the `git archive`
command of docs/megatron-lm.md for the installed version). `python -m megatron_csbp.utils.megatron_lm_path`
prints the directory found, or that line with exit status 1 (what `.ci/run` calls).

Nothing here imports megatron-core (its version is read from the installed distribution's metadata).
"""
from __future__ import annotations

import os
import sys
from typing import Optional, Tuple

#: megatron-core release series -> the Megatron-LM tag whose training package runs on it (the ones run
#: by tests/test_megatron_lm_*.py). Any other series: the tag core_v<version>.
TAGS = {"0.16": "core_v0.16.1", "0.19": "core_v0.19.0"}

#: What each tag's `pretrain_gpt.py` path imports beyond megatron-core (Megatron-LM's `git archive`
#: paths). core_v0.16.1's training package imports megatron.legacy (fused kernels, module utilities);
#: core_v0.19.0 has no megatron/legacy. megatron/post_training and megatron/rl are optional imports of
#: `megatron.training` (guarded) but pretrain_gpt.py's ModelOpt branch and the RL flags name them.
_COMMON_PATHS = ("megatron/training", "megatron/post_training", "megatron/rl", "pretrain_gpt.py", "gpt_builders.py",
                 "model_provider.py", "LICENSE")
PATHS = {"core_v0.16.1": ("megatron/legacy",) + _COMMON_PATHS}

CACHE_ROOT = os.path.join("~", ".cache", "megatron-csbp")


def megatron_core_version() -> Optional[str]:
    """The installed megatron-core's version (distribution metadata), or None when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None


def tag_for(version: Optional[str] = None) -> str:
    """The Megatron-LM tag for megatron-core `version` (default: the installed one)."""
    version = version or megatron_core_version() or "0.16.1"
    series = ".".join(version.split(".")[:2])
    return TAGS.get(series, f"core_v{version.split('+')[0]}")


def archive_paths(tag: str) -> Tuple[str, ...]:
    return PATHS.get(tag, _COMMON_PATHS)


def cache_dir(version: Optional[str] = None) -> str:
    """~/.cache/megatron-csbp/megatron-lm-<tag> for megatron-core `version` (default: the installed one)."""
    return os.path.join(os.path.expanduser(CACHE_ROOT), f"megatron-lm-{tag_for(version)}")


def is_checkout(path: Optional[str]) -> bool:
    """A directory with Megatron-LM's pretrain_gpt.py and training package."""
    return bool(path) and os.path.isfile(os.path.join(path, "pretrain_gpt.py")) and \
        os.path.isfile(os.path.join(path, "megatron", "training", "__init__.py"))


def find(cwd: bool = False) -> Optional[str]:
    """The Megatron-LM directory to import from (module docstring's order), or None."""
    env = os.environ.get("MEGATRON_LM_PATH")
    if env:
        return env if is_checkout(env) else None
    if cwd and is_checkout(os.getcwd()):
        return os.getcwd()
    cache = cache_dir()
    return cache if is_checkout(cache) else None


def missing_message() -> str:
    """One line: why nothing was found and the command that fixes it (for the installed megatron-core)."""
    env, tag, d = os.environ.get("MEGATRON_LM_PATH"), tag_for(), cache_dir()
    if env:
        return (f"MEGATRON_LM_PATH={env} holds no Megatron-LM checkout (pretrain_gpt.py and megatron/training); "
                f"unset it to use {d} or point it at a clone of tag {tag}")
    return (f"Megatron-LM's training package for megatron-core {megatron_core_version() or '(not installed)'} (tag "
            f"{tag}) is not in {d}; get it with: git clone https://github.com/NVIDIA/Megatron-LM /tmp/Megatron-LM && "
            f"mkdir -p {d} && git -C /tmp/Megatron-LM archive {tag} {' '.join(archive_paths(tag))} | tar -x -C {d} "
            "(docs/megatron-lm.md; or set MEGATRON_LM_PATH)")


def main() -> int:
    path = find()
    if path is None:
        print(f"error: {missing_message()}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
