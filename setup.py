"""megatron-csbp: context-sharded block parallelism for block diffusion LMs on Megatron-core."""
from setuptools import find_packages, setup

# CPU pins live in requirements/cpu.txt (one place); install_requires stays a range so that
# GPU clusters keep the torch/megatron-core they already run (0.16 through 0.19 supported).
# install_requires is everything the package imports at run time: transformers is required, not an
# extra, because conversion (`convert`), Hugging Face tokenizers, the model families' HF configs and
# the DFlash verifier all import it (DiffusionGemma and DFlash classes need transformers >= 5.24).
# Extras: `launch` (NeMo-Run for `python -m megatron_csbp.launch`; nemo-run 0.11 imports with
# leptonai < 0.27), `gpu` (TransformerEngine, flash-attn), `test` (pytest and what the tests and
# plots use), `megatron-lm` (what Megatron-LM's training package imports beside megatron-core,
# docs/megatron-lm.md), `dflash-tp` (accelerate, for transformers' tensor parallelism).
#
# Floors and pins that say the truth (tests/test_packaging.py checks them):
# - torch >= 2.9: FlexAttention, the default block-attention kernel on CUDA, asks for the lse with
#   `return_aux=AuxRequest(lse=True)` (attention/flex.py), which torch has from 2.9 on (2.5-2.8
#   spell it `return_lse`). The floor is raised rather than the Flex path guarded: Flex is the CUDA
#   default, and megatron-core itself needs torch >= 2.6.
# - `gpu`: transformer-engine inside the range megatron-core declares: 0.16.1's `dev` extra declares
#   TE >= 2.9.0a0, < 2.12.0; 0.19.2's `te` extra declares TE with no bound, so the intersection of the
#   supported megatron-core releases is 0.16.1's range. flash-attn 2.x (3.x is another API,
#   flash_attn_interface) from 2.8.3: the code needs >= 2.3 (window_size, attention/flash.py), but
#   releases before 2.8.3 publish no wheel for a torch >= 2.8 and predate torch 2.9. Both build
#   against the installed torch: `pip install --no-build-isolation` (docs/install.md).
setup(
    name="megatron-csbp",
    version="0.1.0",
    description="Block and context-sharded block parallelism for block diffusion LMs in Megatron",
    packages=find_packages(include=["megatron_csbp", "megatron_csbp.*"]),
    package_data={"megatron_csbp": ["data/assets/*"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.9",
        "megatron-core>=0.16.1,<0.20",
        "numpy",
        "sentencepiece",
        "safetensors",
        "packaging",
        "psutil",
        "tqdm",
        "pyyaml",
        "transformers>=5.24,<6",
        # data/tokenizer.py builds the export's tokenizer.json with it (transformers 5.24 requires 0.23)
        "tokenizers>=0.23",
        # sentencepiece's model proto (the export reads a SentencePiece model with it) imports
        # google.protobuf, which neither sentencepiece nor transformers requires
        "protobuf",
        # --tensorboard-dir (torch.utils.tensorboard), which the `demo` command sets
        "tensorboard",
        # LoRA export/import as a PEFT adapter (conversion/lora.py, imported only for LoRA): peft
        # reads and writes its own format; 0.21 is the release whose target_parameters layout of 3D
        # expert stacks (ParamWrapper) the export writes (docs/lora.md)
        "peft>=0.21.2,<0.22",
    ],
    extras_require={
        "test": ["pytest", "pytest-timeout", "matplotlib"],
        "launch": ["nemo-run>=0.11,<0.12", "leptonai<0.27"],
        "megatron-lm": ["six", "flask-restful", "tiktoken", "einops", "triton"],
        "dflash-tp": ["accelerate"],
        # Megatron's --wandb-project / --wandb-exp-name logging (imported only when asked for)
        "wandb": ["wandb"],
        # NVIDIA apex is a from-source build (see docs/install.md); the PyPI "apex" is unrelated.
        "gpu": ["transformer-engine[pytorch]>=2.9,<2.12", "flash-attn>=2.8.3,<3"],
    },
)
