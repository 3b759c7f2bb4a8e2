"""What every `python -m megatron_csbp.*` command shares: one-line errors and quiet library warnings.

`ArgumentParser` (no usage dump), `CliError` (`agreed=False` when only some ranks see it),
`run(main, argv)` (exit status 2 bad input, 1 a stopped run; `MEGATRON_CSBP_TRACEBACK=1`
re-raises) and `filter_warnings()`. Behaviour under torchrun and which warnings are hidden:
docs/training.md#failing-loudly.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import warnings
from typing import Callable, NoReturn, Optional, Sequence


class CliError(Exception):
    """A failure with a message a user can act on (it names the flag, file or iteration)."""

    exit_code = 1

    def __init__(self, message: str, agreed: bool = True):
        super().__init__(message)
        self.agreed = agreed


class UsageError(CliError):
    """Bad input (a flag or its value): exit status 2, as argparse's."""

    exit_code = 2


class Interrupted(CliError):
    """Stopped by SIGINT (Ctrl-C): exit status 130, as a shell reports it."""

    exit_code = 130


def rank() -> Optional[int]:
    """This process's global rank: torch.distributed's once initialized, else torchrun's RANK, else None."""
    dist = sys.modules.get("torch.distributed")  # not imported by torch-free entry points (plan)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    r = os.environ.get("RANK", "")
    return int(r) if r.isdigit() else None


def report(message: str, agreed: bool = True) -> bool:
    """Print `error: message` as one line on stderr, if this rank is the one to say it (True then)."""
    r = rank()
    if agreed and r not in (None, 0):
        return False
    prefix = "error: " if agreed or r is None else f"error (rank {r}): "
    line = prefix + " ".join(part.strip() for part in str(message).strip().splitlines())
    print(line, file=sys.stderr, flush=True)
    _tell_torchrun(line)
    return True


def fail(message: str, code: int = 2, agreed: bool = True) -> NoReturn:
    """`report` the line and exit with `code` (SystemExit, so `finally` blocks run)."""
    if not report(message, agreed):
        # Rank 0 says it and carries the status. Under torchrun a rank that exits nonzero makes the
        # agent kill the others at once, possibly before rank 0 printed: the other ranks exit 0.
        sys.exit(0 if "TORCHELASTIC_RUN_ID" in os.environ else code)
    sys.exit(code)


def _tell_torchrun(line: str) -> None:
    """Under torchrun, the line goes into the worker's error file too: torchrun's failure summary
    then shows it (instead of "To enable traceback see ...")."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    import json
    import time

    with contextlib.suppress(OSError), open(path, "w") as f:
        json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                              "timestamp": str(int(time.time()))}}}, f)


class ArgumentParser(argparse.ArgumentParser):
    """argparse without the usage dump: an argument error is one line (`fail`), exit status 2. A
    shortened flag is refused as unrecognized (`allow_abbrev=False`, as Megatron-LM's parser): a
    prefix of a flag is a misspelling, and a later flag sharing that prefix would change its meaning."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        fail(f"{message} (see {self.prog} --help)" if message.startswith(("unrecognized arguments",
                                                                          "the following arguments"))
             else message, 2)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """`--help` with each flag's default after its help ("unset" for None), unless the help names it."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        if action.default is argparse.SUPPRESS or not action.option_strings or re.search(
                r"(^|\()(the )?default\b|default:", text):
            return text
        if action.nargs == 0:  # a switch: off unless given (--no-X: on unless given)
            return f"{text} (default: not given)"
        default = "unset" if action.default is None else " ".join(map(str, action.default)) \
            if isinstance(action.default, (list, tuple)) else "%(default)s"
        return f"{text} (default: {default})"


def run(main: Callable, argv: Optional[Sequence[str]] = None) -> int:
    """Call `main(argv)`; its int result is the exit status (anything else means 0). A `CliError` or
    `ValueError` becomes the one line."""
    try:
        result = main(argv) if argv is not None else main()
    except (KeyboardInterrupt, CliError, ValueError) as exc:
        if os.environ.get("MEGATRON_CSBP_TRACEBACK"):
            raise
        if isinstance(exc, KeyboardInterrupt):
            fail("interrupted by SIGINT", Interrupted.exit_code)
        fail(str(exc), exc.exit_code if isinstance(exc, CliError) else 2, getattr(exc, "agreed", True))
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


#: (action, message regex, category, module regex) as `warnings.filterwarnings` takes them
FILTERS = (
    ("ignore", r"(Transformer Engine and Apex are|Apex is) not installed", UserWarning, r"megatron\."),
    ("ignore", r"full scope is deprecated", UserWarning, r"megatron\.core"),
    # megatron-core >= 0.19 warns at import that its multimodal MimoModelConfig is experimental
    ("ignore", r"MimoModelConfig is experimental", UserWarning, r"megatron\.core"),
    # megatron-core >= 0.19 reads a checkpoint's common state with dcp.load(..., no_dist=True) in
    # torch's older argument style: torch warns about both on every resume
    ("ignore", r"(torch\.distributed is disabled, unavailable or uninitialized|The argument order of load has been "
               r"changed)", UserWarning, r"torch\.distributed\.checkpoint(\.|$)"),
    ("ignore", "", FutureWarning, r"(megatron\.core|torch\.distributed\.checkpoint)(\.|$)"),
    # torch >= 2.10 deprecates the collectives megatron-core calls (DDP, the distributed optimizer)
    ("ignore", r"`torch\.distributed\.\w+` is deprecated", FutureWarning, r"torch\.distributed\.c10d_logger$"),
    ("ignore", "", DeprecationWarning, r"(megatron\.core|torch\.distributed\.checkpoint)(\.|$)"),
)


def _not_no_cuda_runtime(record) -> bool:
    """torch's CUDA build on a machine without a CUDA driver logs "No CUDA runtime is found" when
    megatron-core imports torch.utils.cpp_extension; nothing here compiles an extension."""
    return not str(record.msg).startswith("No CUDA runtime is found")


#: warnings that only a CUDA run can act on (megatron-core's TP layers ask for CUDA_DEVICE_MAX_CONNECTIONS=1)
CUDA_ONLY = (("ignore", r"When using .* CUDA_DEVICE_MAX_CONNECTIONS to 1", UserWarning, r"megatron\.core"),)


def filter_warnings() -> None:
    """Install `FILTERS`, and `CUDA_ONLY` where torch is loaded and sees no CUDA (idempotent: `warnings`
    drops duplicate filters); drop torch's no-CUDA-runtime log line (`_not_no_cuda_runtime`)."""
    import logging

    torch = sys.modules.get("torch")
    cpu = torch is not None and not torch.cuda.is_available()
    for action, message, category, module in FILTERS + (CUDA_ONLY if cpu else ()):
        warnings.filterwarnings(action, message=message, category=category, module=module)
    logger = logging.getLogger("torch.utils.cpp_extension")
    if _not_no_cuda_runtime not in logger.filters:
        logger.addFilter(_not_no_cuda_runtime)
