"""`convert score --reset-attention-mask --reset-position-ids --eod-token-id N`: a packed pair of
documents (each starting on a block edge) scores as each document alone, next-token logits and
block-diffusion logits of noisy rows (fp32; the same model on the same rows, only the keys other
documents add are gone: their softmax weight is exactly 0, so what differs is the summation
order over fewer tiles, ~u32 x sqrt(keys) x layers relative to the logits' magnitude (this tiny
model's logits reach ~20: on this machine's torch 2.13.0 the worst packed-vs-alone difference was
1.0e-5 at |logit| 17, i.e. 6e-7 relative); the bound is 1e-5 relative to the largest |logit|,
which leaves >10x over that)."""
import numpy as np
import pytest

pytest.importorskip("transformers")

from megatron_csbp.conversion import api  # noqa: E402
from megatron_csbp.conversion.tiny import save_tiny_model  # noqa: E402
from megatron_csbp.layout.packing import Packing  # noqa: E402
from tests.test_convert_cli import convert  # noqa: E402

EOD, B, TOL = 7, 8, 1e-5


def _close(got, want) -> bool:
    """fp32 agreement relative to the logits' magnitude (the module docstring's error model)."""
    return np.abs(got - want).max() <= TOL * max(1.0, float(np.abs(want).max()))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("score_packed")
    save_tiny_model("qwen3", str(tmp / "hf"), seed=3)
    api.hf_to_megatron_checkpoint(str(tmp / "hf"), str(tmp / "meg"))
    return tmp


def _docs():
    rs = np.random.RandomState(1)
    a, b = rs.randint(8, 128, size=16), rs.randint(8, 128, size=24)
    a[-1] = EOD  # document A ends with its EOD
    return a, b


def test_packed_pair_scores_as_each_alone(checkpoint):
    meg = str(checkpoint / "meg")
    a, b = _docs()
    packed = np.concatenate([a, b])[None]
    pk = Packing(EOD, reset_attention_mask=True, reset_position_ids=True)
    # Next-token logits.
    got = api.score(meg, packed, packing=pk)
    want = np.concatenate([api.score(meg, a[None]), api.score(meg, b[None])], axis=1)
    assert _close(got, want)
    assert np.abs(api.score(meg, packed)[:, 16:] - want[:, 16:]).max() > 1e-3  # unpacked: B sees A
    # Block-diffusion logits of noisy rows.
    rs = np.random.RandomState(2)
    noisy = np.where(rs.rand(*packed.shape) < 0.5, 0, packed)
    got = api.score(meg, packed, noisy_tokens=noisy, block_size=B, packing=pk)
    want = np.concatenate([api.score(meg, a[None], noisy_tokens=noisy[:, :16], block_size=B),
                           api.score(meg, b[None], noisy_tokens=noisy[:, 16:], block_size=B)], axis=1)
    print(f"\npacked vs alone, noisy rows: max |diff| {np.abs(got - want).max():.2e}")
    assert _close(got, want)


@pytest.mark.slow  # a subprocess per call; the scoring itself is the default test above
def test_cli_flags(checkpoint):
    meg, tmp = str(checkpoint / "meg"), checkpoint
    a, b = _docs()
    np.save(tmp / "ids.npy", np.concatenate([a, b])[None].astype(np.int32))
    r = convert("score", "--load", meg, "--tokens", str(tmp / "ids.npy"), "--output", str(tmp / "out.npy"),
                "--reset-attention-mask", "--reset-position-ids", "--eod-token-id", str(EOD))
    assert r.returncode == 0, r.stderr[-3000:]
    want = np.concatenate([api.score(meg, a[None]), api.score(meg, b[None])], axis=1)
    assert _close(np.load(tmp / "out.npy"), want)
    r = convert("score", "--load", meg, "--tokens", str(tmp / "ids.npy"), "--output", str(tmp / "out.npy"),
                "--reset-attention-mask")
    assert r.returncode == 2 and "--reset-attention-mask / --reset-position-ids need --eod-token-id N" in r.stderr
