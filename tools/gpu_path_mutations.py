"""The GPU path's changes, each reverted (or broken) in a copy of the tree, one at a time: the tests that guard it
must fail (benchmarks/README.md, "which test guards which change"). No GPU needed.

    python tools/gpu_path_mutations.py [INDEX ...]      (default: every mutation; prints one line each, exit 1 if
                                                         a mutation leaves its tests passing)
"""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
T = "tests/test_gpu_path.py::"
MUTATIONS = [
 ("controller decides on reserved memory (the last round's reading)", "minimind_lib/memory.py",
  '''        if self.is_cuda:
            split = torch.cuda.memory_stats(self.device).get("inactive_split_bytes.all.peak", 0)
            return torch.cuda.max_memory_allocated(self.device) + split''',
  '''        if self.is_cuda:
            free, total = torch.cuda.mem_get_info(self.device)
            outside = total - free - torch.cuda.memory_reserved(self.device)
            return torch.cuda.max_memory_reserved(self.device) + max(outside, 0)''',
  [T + "test_a_pressure_spike_shrinks_once_and_the_batch_grows_back",
   T + "test_a_steady_load_never_moves_the_batch_while_the_cache_grows", T + "test_the_driver_is_read_once_per_check"]),
 ("the driver read every step, not once per check", "minimind_lib/batching.py",
  '''            self._window_peak = max(self._window_peak, self._peak())''',
  '''            self._window_peak = max(self._window_peak, self._peak()
                                    + getattr(self.meter, "end_window", lambda: 0)())''',
  [T + "test_the_driver_is_read_once_per_check"]),
 ("fit reads the device in float64 (MPS has none)", "minimind_lib/train.py",
  '''torch.stack([r[k].detach().float() for r, k in keys])''', '''torch.stack([r[k].detach().double() for r, k in keys])''',
  [T + "test_fit_runs_through_a_fake_mps_layer"]),
 ("the meter's TorchDispatchMode on MPS", "minimind_lib/memory.py",
  '''self.counted_by_allocator = self.device.type in ("cuda", "mps")''', '''self.counted_by_allocator = self.device.type == "cuda"''',
  [T + "test_fit_runs_through_a_fake_mps_layer"]),
 ("OOM recovery empties only CUDA's cache", "minimind_lib/batching.py",
  '''        empty_cache(getattr(self.meter, "device", None))''', '''        torch.cuda.empty_cache()''',
  [T + "test_fit_runs_through_a_fake_mps_layer"]),
 ("MPS's cache not released at a check (MPS keeps no peak)", "minimind_lib/memory.py",
  '''        if self.device.type == "mps":
            torch.mps.empty_cache()
        if not self.is_cuda:''', '''        if not self.is_cuda:''',
  [T + "test_peak_in_use_reads_the_mps_driver_and_releases_its_cache_per_window", T + "test_fit_runs_through_a_fake_mps_layer"]),
 ("AdamW not fused on MPS", "minimind_lib/train.py",
  '''in ("cuda", "mps", "cpu")''', '''in ("cuda", "cpu")''',
  [T + "test_build_optimizer_fuses_on_every_device_that_has_the_kernel"]),
 ("int(position_ids.max()) back on every device", "minimind_lib/model.py",
  '''            if on_cpu(position_ids) and (''', '''            if (''',
  [T + "test_the_forward_and_backward_read_no_device_value"]),
 ("the fused on-device NaN skip removed", "minimind_lib/train.py",
  '''    elif optimizer.defaults.get("fused"):''', '''    elif False:''',
  [T + "test_a_fused_step_skips_nan_on_the_device_without_a_read"]),
 ('"auto" always the dense mask', "minimind_lib/batching.py",
  '''    if kernel == "dense" or (kernel == "auto" and device.type != "cuda"):''', '''    if kernel in ("dense", "auto"):''',
  [T + "test_auto_masks_packed_rows_with_flex_attention_on_cuda"]),
 ("FlexAttention uncompiled on CUDA", "minimind_lib/model.py",
  '''    if device_type == "cuda":
        return torch.compile(flex_attention.flex_attention)''', '''    if False:
        return torch.compile(flex_attention.flex_attention)''',
  [T + "test_flex_attention_runs_compiled_on_cuda"]),
 ("the block mask rebuilt for every micro-batch", "minimind_lib/batching.py",
  '''    if key in _RECENT_MASKS:''', '''    if False:''',
  [T + "test_the_block_mask_is_reused_when_the_lengths_repeat"]),
 ("the allocator setting by its deprecated name", "minimind_lib/device.py",
  '''        os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"''',
  '''        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"''',
  [T + "test_get_device_sets_up_cuda_before_it_allocates"]),
 ("no warning for bf16 on a GPU without native bf16", "minimind_lib/device.py",
  '''        if device.type == "cuda" and not bf16_native(device):''', '''        if False:''',
  [T + "test_the_gpu_profile_fits_a_free_t4_by_the_estimate"]),
 ("log_every defaults to 1 (a read every step)", "minimind_lib/config.py",
  '''    log_every: int = 10''', '''    log_every: int = 1''',
  [T + "test_log_every_defaults_to_a_window"]),
 ("the chunked loss ignored by the loop (whole logits)", "minimind_lib/train.py",
  '''    if not loss_chunk:
        logits, aux = forward_logits''', '''    if True:
        logits, aux = forward_logits''',
  [T + "test_the_loop_with_the_chunked_loss_trains_as_with_the_full_logits"]),
 ("the chunked loss trains ignored positions", "minimind_lib/model.py",
  '''        grad = grad.mul_(trained).to(weight.dtype)''', '''        grad = grad.to(weight.dtype)''',
  [T + "test_chunked_linear_cross_entropy_equals_the_full_logits"]),
 ("the estimate ignores the chunked loss", "minimind_lib/memory.py",
  '''    if loss_chunk:
        extra = 0 if amp == "off" else s''', '''    if False:
        extra = 0 if amp == "off" else s''',
  [T + "test_the_chunked_loss_estimate_matches_the_measured_step", T + "test_the_gpu_profiles_micro_batch_is_the_planners_choice"]),
 ("the gpu profile's micro-batch back to 32 x 2", "minimind_lib/profiles.py",
  '''    "gpu": Profile(name="gpu", model="minimind2-small", seq_len=512, batch_size=64, accum_steps=1,''',
  '''    "gpu": Profile(name="gpu", model="minimind2-small", seq_len=512, batch_size=32, accum_steps=2,''',
  [T + "test_the_gpu_profiles_micro_batch_is_the_planners_choice"]),
 ("the pipeline does not compile", "minimind_lib/pipeline.py",
  '''        model.model.compile()''', '''        pass''',
  [T + "test_a_compiled_chunked_bucketed_run_trains_as_the_eager_one"]),
 ("the controller counts rows unbucketed", "minimind_lib/batching.py",
  '''    padded = [[round_up(row_length(s, seq_len), multiple, seq_len) for s in g] for g in groups]''',
  '''    padded = [[row_length(s, seq_len) for s in g] for g in groups]''',
  [T + "test_rows_are_padded_to_a_few_lengths_within_the_budget"]),
 ('"H100" matches H100 PCIe/NVL (the old table)', "benchmarks/throughput.py",
  '''SPEC_PEAK_FLOPS = (("H100 PCIe", 756e12, "bf16"), ("H100 NVL", 835e12, "bf16"), ("H100", 989e12, "bf16"),''',
  '''SPEC_PEAK_FLOPS = (("H100", 989e12, "bf16"), ''',
  ["tests/test_bench_throughput.py::test_default_repeats_and_the_spec_peak_table"]),
]


def main(only: list[str]) -> int:
    """Run each selected mutation in a fresh copy of the tree; 0 if every one made its tests fail."""
    survived = 0
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "tree"
        shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", ".venv", "build", "runs", "cache"))
        for i, (what, path, old, new, tests) in enumerate(MUTATIONS):
            if only and str(i) not in only:
                continue
            target = copy / path
            original = target.read_text(encoding="utf-8")
            if original.count(old) != 1:
                print(f"[{i}] {what}: the code to revert is not in {path} as written (update this list)")
                survived += 1
                continue
            target.write_text(original.replace(old, new), encoding="utf-8")
            try:
                r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=copy,
                                   capture_output=True, text=True, env={**os.environ, "MINIMIND_PROFILE": "smoke"})
            finally:
                target.write_text(original, encoding="utf-8")
            summary = (r.stdout.strip().splitlines() or ["(no output)"])[-1]
            survived += r.returncode == 0
            print(f"[{i}] {'caught' if r.returncode else 'NOT CAUGHT'}: {what}: {summary}", flush=True)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
