"""megatron-core (and Megatron-LM's training loop) without TE/apex, and on CPU gloo ranks: two layers.

1. Library fixes (`compat.libraries.install_library_fixes`), installed on EVERY device, each keyed
   on the library megatron-core runs without, never on the device:
   - `compat.norms`: megatron-core's torch norm (TE absent, or the local spec, which the trainer
     always uses) under TP sequence parallelism;
   - `compat.moe.patch_te_general_gemm`: MoE's router GEMM names `te_general_gemm`, defined only
     with TE;
   - `compat.optimizer.patch_torch_adam`: the distributed optimizer over torch Adam (TE's and
     apex's fused Adam absent): per-parameter `step` on load, the state before the first step,
     the fully-reshardable load's keys.
2. Device relocation, installed only when CUDA is absent (`compat.cpu.install_cpu_compat()`, also
   named `install_compat`, installs layer 1 and then, without CUDA, this layer;
   `compat.megatron_lm.install_megatron_lm_cpu_compat()` adds Megatron-LM's), in this order:
   1. `compat.device`: megatron modules that name CUDA see a `torch` whose CUDA is the CPU.
   2. `compat.rng`: Megatron's RNG tracker and recompute RNG get/set on the CPU generator.
   3. `compat.optimizer.patch_cpu_optimizers`: CUDA type-name checks, the DP-zero gather's gloo branch.
   4. `compat.moe.patch_moe`: MoE's all-to-all split sizes as lists (gloo).
   5. `compat.pipeline`: the tied-embedding copy under pipeline parallelism; sent stage outputs
      kept alive until gloo has sent them.

The trainer, generate, the converter and the bench call `install_cpu_compat()` / `install_compat()`;
Megatron-LM scripts get layer 1 from `megatron_csbp.training.megatron_lm.install()`. tests/test_cuda_shaped.py
runs the trainer with CUDA "present" and TE/apex absent, so only layer 1 is installed there.

Which patches change numerics (each claim checked against the patch; docs/compat.md has the same list):

Only relocate devices or lift CUDA-only checks (numerics unchanged):
- device proxy: CUDA `device=` factories and `current_device()` give the CPU; streams and events
  are no-ops (CPU work is synchronous); `synchronize` / `empty_cache` do nothing (also in
  megatron-core's pipeline P2P, `pipeline_parallel.p2p_communication`).
- pipeline (`compat.pipeline`): the tied-embedding copy of the last pipeline stage is all-reduced
  where it is (the CPU) instead of moved to CUDA first: the same all-reduce of the same values.
- optimizer: CPU tensors report `torch.cuda.*` type names inside `clip_grad_by_total_norm_fp32`
  and the optimizers' constructors (same fp32 math); the DP-zero state gather takes its gloo
  branch (same gathers); the fully-reshardable load copies the keys present (no KeyError);
  `state_dict` before the first step creates the zero state torch Adam creates at its first step.
- MoE: `te_general_gemm = None` (TE absent, every device) selects megatron-core's own non-TE router
  GEMM; all-to-all split sizes become lists (same sizes); the dispatcher's side stream is the
  no-op stream.
- Megatron-LM (`compat.megatron_lm`): `allow_no_cuda`, one device (`device_count() == 1`,
  `set_device` no-op), no fused-kernel build, architecture version 0, `.cuda()` is the identity.

Change numbers, or decide which numbers are drawn:
- RNG: random draws (dropout, anything drawn under the tracker) come from the CPU generator's
  stream for the given seeds, not CUDA's: reproducible and replayed exactly under recompute, but
  not a GPU run's numbers. `model_parallel_cuda_manual_seed` calls `torch.cuda.manual_seed(seed)`,
  which through the proxy reseeds the CPU default generator (on GPU the CUDA one). The
  objectives' noise comes from their own `torch.Generator`s, untouched.
- optimizer: `DistributedOptimizer.load_state_dict` with torch Adam gives each parameter its own
  `step` tensor. Unpatched, one shared tensor is incremented once per parameter and a resumed run
  silently uses wrong bias corrections; patched, it matches an uninterrupted run.
- norms: torch norms under `--sequence-parallel` (unpatched: refused) get their gradients
  all-reduced over TP, as TE norms do: the numerics of the GPU path.
- memory statistics read 0: logged numbers only, never the model's.
- Megatron-LM's `_warmup_jit_function` runs under `torch.random.fork_rng`: this one prevents a
  change (its CPU draws would otherwise shift the initial weights with the CP size).
- pipeline: a stage output pseudo-deallocated after its send (Megatron-LM's
  `deallocate_pipeline_outputs`) keeps its old storage until its backward: this one prevents a
  change too (unpatched, the interleaved schedule's asynchronous gloo send read freed memory and
  Megatron-LM's PP x VP losses changed from run to run).
"""
