"""Tool-use SFT end to end on CPU: examples/sft_agent/README.md.

For a tiny DiffusionGemma (diffusiongemma-sft, one sample per assistant turn) and a tiny
Qwen3-style model (BD3-LM, every turn in one sample): tokenizer + chat template, convert, show the
rendered data with its supervised spans, train under CSBP on 2 ranks, export to Hugging Face, and
decode with transformers' `generate` from a prompt built by the same chat template.
"""
import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DATA = os.path.join(HERE, "trajectories.jsonl")
SPECIAL = ["<|im_start|>", "<|im_end|>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_function_call>",
           "<end_function_call>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
VOCAB = 512  # model rows; the tokenizer has 384 pieces + specials
PROMPT = {"tools": None, "messages": [{"role": "system", "content": "You are a helpful assistant with tools."},
                                      {"role": "user", "content": "What is the weather in Paris?"}]}
MODELS = {
    "diffusiongemma": dict(template="gemma_tools.jinja", flags=[
        "--objective", "diffusiongemma-sft", "--sft-trajectory-turns", "all", "--block-size", "16"]),
    "qwen3": dict(template="chatml_tools.jinja", flags=[
        "--objective", "bd3lm", "--mask-token", "<|mask|>", "--block-size", "16"]),
}


def run(*cmd, env=None):
    print("$", " ".join(cmd), flush=True)
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r.stdout


def hf_model(name: str, folder: str) -> None:
    """The tiny model and the tokenizer with the example's chat template, in one Hugging Face folder."""
    from megatron_csbp.conversion.tiny import save_tiny_model, save_tiny_tokenizer
    from megatron_csbp.model.diffusiongemma.tiny import tiny_hf_model

    if name == "diffusiongemma":
        tiny_hf_model(seed=2, vocab_size=VOCAB, sliding_window=16, redraw=False).save_pretrained(folder)
    else:
        save_tiny_model("qwen3", folder, seed=5, vocab_size=VOCAB)
    tok = save_tiny_tokenizer(folder)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.bos_token = "<bos>"
    with open(os.path.join(HERE, MODELS[name]["template"])) as f:
        tok.chat_template = f.read()
    tok.save_pretrained(folder)


def decode(name: str, export: str, new_tokens: int) -> str:
    """transformers' `generate` on the export, the prompt from the export's own chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(export)
    prompt = {"tools": [t for t in _tools()], "messages": PROMPT["messages"]}
    ids = tok.apply_chat_template(prompt["messages"], tools=prompt["tools"], add_generation_prompt=True,
                                  tokenize=True, return_dict=True, return_tensors="pt")["input_ids"]
    torch.manual_seed(0)
    if name == "diffusiongemma":
        from transformers import DiffusionGemmaForBlockDiffusion

        model = DiffusionGemmaForBlockDiffusion.from_pretrained(export).eval()
        out = model.generate(ids, max_new_tokens=new_tokens).sequences
    else:
        model = AutoModelForCausalLM.from_pretrained(export).eval()
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:])


def _tools():
    import json

    with open(DATA) as f:
        return json.loads(f.readline())["tools"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workdir", default="/tmp/sft_agent")
    p.add_argument("--train-iters", type=int, default=30)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    a = p.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    for name in a.models:
        root = os.path.join(a.workdir, name)
        hf, meg, save, export = (os.path.join(root, d) for d in ("hf", "megatron", "trained", "export"))
        hf_model(name, hf)
        run(sys.executable, "-m", "megatron_csbp.convert", "hf-to-megatron", "--hf-path", hf, "--output", meg, env=env)
        tokenizer = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", os.path.join(meg, "hf_assets")]
        shown = run(sys.executable, "-m", "megatron_csbp.data.inspect", "--sft-data-path", DATA, *tokenizer, env=env)
        print(shown.split("--- line", 2)[0] + "--- line" + shown.split("--- line", 2)[1])  # the first record
        out = run("torchrun", "--nproc-per-node", "2", "-m", "megatron_csbp.train", "--load", meg, *tokenizer,
                  "--sft-data-path", DATA, *MODELS[name]["flags"], "--context-parallel-size", "2",
                  "--block-parallel-size", "2", "--seq-length", "640", "--micro-batch-size", "1",
                  "--global-batch-size", "2", "--train-iters", str(a.train_iters), "--lr", "3e-3", "--min-lr", "3e-4",
                  "--log-interval", "5", "--no-progress-bar", "--save", save, "--save-interval", str(a.train_iters),
                  env=env)
        print("\n".join(line for line in out.splitlines() if "lm loss" in line or "SFT data" in line))
        run(sys.executable, "-m", "megatron_csbp.convert", "megatron-to-hf", "--load", save, "--output", export, env=env)
        print(f"[{name}] transformers generate: {decode(name, export, 16)!r}\n", flush=True)


if __name__ == "__main__":
    main()
