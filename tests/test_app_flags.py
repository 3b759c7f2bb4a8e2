"""Every app's parser refuses a shortened flag (issue 42: `demo` and `explain` used plain argparse,
which takes `--hidden-siz` for `--hidden-size`). Each case is a valid command line with one flag cut
short: the app must name it as unrecognized, in one line, exit status 2; the same line with the
flag in full parses."""
import pytest


def _train(argv):
    from megatron_csbp.training.arguments import build_parser
    return build_parser().parse_args(argv)


def _generate(argv):
    from megatron_csbp.generation.decode import build_parser
    return build_parser().parse_args(argv)


def _convert(argv):
    from megatron_csbp.conversion.cli import _parser
    return _parser().parse_args(argv)


def _dflash(argv):
    from megatron_csbp.dflash import build_parser
    return build_parser().parse_args(argv)


def _launch(argv):
    from megatron_csbp.launch.recipes import parse_args
    return parse_args(argv)


def _explain(argv):
    from megatron_csbp.explain import parse_args
    return parse_args(argv)


def _plan(argv):
    from megatron_csbp.planner.cli import parse_args
    return parse_args(argv)


def _demo(argv):
    from megatron_csbp.demo import parse_args
    return parse_args(argv)


#: app -> (its parse function, a command line, the flag of it that the test cuts short)
APPS = {
    "train": (_train, ["--hidden-size", "64", "--num-layers", "2"], "--hidden-size"),
    "generate": (_generate, ["--load", "ckpt", "--prompt", "x", "--max-new-tokens", "3"], "--max-new-tokens"),
    "convert": (_convert, ["megatron-to-hf", "--load", "ckpt", "--output", "out", "--dtype", "bfloat16"], "--dtype"),
    "dflash": (_dflash, ["export", "--load", "ckpt", "--output", "out", "--tokenizer-model", "t"], "--tokenizer-model"),
    "launch": (_launch, ["a_recipe.yaml", "--nproc-per-node", "2"], "--nproc-per-node"),
    "explain": (_explain, ["--seq-length", "64", "--block-size", "8", "--context-parallel-size", "2"],
                "--context-parallel-size"),
    "plan": (_plan, ["--seq-length", "4096", "--gpus", "8"], "--gpus"),
    "demo": (_demo, ["--steps", "3", "--hidden-size", "64"], "--hidden-size"),
}


@pytest.mark.quick
@pytest.mark.parametrize("app", sorted(APPS))
def test_every_app_refuses_a_shortened_flag(app, capsys):
    parse, argv, flag = APPS[app]
    assert parse(argv) is not None  # the command line in full parses
    short = [a[:-1] if a == flag else a for a in argv]
    with pytest.raises(SystemExit) as exc:
        parse(short)
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: unrecognized arguments: {flag[:-1]}"), err
