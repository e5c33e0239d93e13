"""Reference vs Triton rejection sampling, timed side by side: `python -m kernels.bench_rejection`.

With no CUDA device, Triton runs under its interpreter (TRITON_INTERPRET=1), which times Python, not a GPU:
those numbers only show the kernel runs and agrees. On CUDA it also prints achieved bandwidth against the
memory floor (every byte of p, and of q at a rejected position, at each request's final row read once;
the draw reads them twice). `random_inputs` is shared
with the kernel tests.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor

# (batch, k, vocab_size): decode-sized batches over common vocabularies
CUDA_SIZES = [(8, 5, 49152), (64, 4, 32000), (256, 3, 128256), (32, 8, 152064)]
INTERPRETER_SIZES = [(8, 5, 49152), (16, 3, 4096), (4, 4, 32000)]


def random_inputs(
    num_drafts: list[int],  # k of each request
    vocab_size: int,
    *,
    has_draft_probs: bool,
    greedy_fraction: float,
    seed: int,
    device: str | torch.device = "cpu",
) -> dict[str, Tensor | int | None]:
    """Keyword arguments for `rejection_sample`: drafts drawn from q, so acceptance really varies.

    Greedy requests draft argmax p two times in three, so their acceptances happen too.
    """
    gen = torch.Generator(device).manual_seed(seed)
    rand = {"generator": gen, "device": device}
    batch, num_draft_tokens = len(num_drafts), sum(num_drafts)
    target_probs = (torch.randn(num_draft_tokens + batch, vocab_size, **rand) * 3).softmax(-1)
    draft_probs = (torch.randn(num_draft_tokens, vocab_size, **rand) * 3).softmax(-1)
    draft_token_ids = torch.multinomial(draft_probs, 1, generator=gen).squeeze(1)  # [num_draft_tokens]
    is_greedy = torch.rand(batch, **rand) < greedy_fraction  # [batch]
    num_drafts_t = torch.tensor(num_drafts, dtype=torch.int64, device=device)
    request_of_token = torch.repeat_interleave(torch.arange(batch, device=device), num_drafts_t)
    target_rows = torch.arange(num_draft_tokens, device=device) + request_of_token
    target_argmax = target_probs.argmax(-1)  # [num_draft_tokens + batch]
    use_argmax = is_greedy[request_of_token] & (torch.rand(num_draft_tokens, **rand) < 2 / 3)
    draft_token_ids = torch.where(use_argmax, target_argmax[target_rows], draft_token_ids)
    return {
        "draft_token_ids": draft_token_ids,
        "cu_num_draft_tokens": torch.cumsum(num_drafts_t, 0),
        "draft_probs": draft_probs if has_draft_probs else None,
        "target_probs": target_probs,
        "target_argmax": target_argmax,
        "is_greedy": is_greedy,
        "acceptance_uniforms": torch.rand(num_draft_tokens, **rand),
        "sample_uniforms": torch.rand(num_draft_tokens + batch, dtype=torch.float64, **rand),
        "max_spec_len": max(num_drafts, default=0),
    }


def _median_seconds(fn: Callable[[], Tensor], repeats: int, is_cuda: bool) -> float:
    fn()  # warm-up (and Triton compile)
    times = []
    for _ in range(repeats):
        if is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _copy_bandwidth_gbs() -> float:
    """Device memory bandwidth seen by a plain copy (read + write), the practical ceiling."""
    src = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = _median_seconds(lambda: dst.copy_(src), 20, is_cuda=True)
    return 2 * src.numel() / seconds / 1e9


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: busy-waiting threads collapse when other "
                             "processes share the cores)")
    torch.set_num_threads(parser.parse_args().threads)
    is_cuda = torch.cuda.is_available()
    if not is_cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # NOTE: must precede the first `import triton`
    from kernels.rejection_reference import rejection_sample as reference
    from kernels.rejection_triton import rejection_sample as triton_kernel

    device = "cuda" if is_cuda else "cpu"
    sizes = CUDA_SIZES if is_cuda else INTERPRETER_SIZES
    repeats = 20 if is_cuda else 3
    if is_cuda:
        peak = _copy_bandwidth_gbs()
        print(f"device: {torch.cuda.get_device_name()}, copy bandwidth {peak:.0f} GB/s")
    else:
        peak = float("nan")
        print(f"device: {_cpu_model()}, {torch.get_num_threads()} torch threads, no CUDA: Triton runs "
              "under TRITON_INTERPRET=1 (Python speed, not a GPU timing: the speedup column only shows the "
              "interpreter's cost)")
    header = f"{'batch':>5} {'k':>2} {'vocab':>6} {'q':>7} {'reference ms':>12} {'triton ms':>10} " \
             f"{'speedup':>7} {'equal':>5}"
    print(header + ("  triton GB/s  floor ms" if is_cuda else ""))
    for batch, k, vocab_size in sizes:
        for has_draft_probs in (True, False):
            args = random_inputs([k] * batch, vocab_size, has_draft_probs=has_draft_probs,
                                 greedy_fraction=0.25, seed=0, device=device)
            equal = torch.equal(reference(**args), triton_kernel(**args))
            ref_s = _median_seconds(lambda a=args: reference(**a), repeats, is_cuda)
            tri_s = _median_seconds(lambda a=args: triton_kernel(**a), repeats, is_cuda)
            line = (f"{batch:>5} {k:>2} {vocab_size:>6} {'given' if has_draft_probs else 'one-hot':>7} "
                    f"{ref_s * 1e3:>12.3f} {tri_s * 1e3:>10.3f} {ref_s / tri_s:>7.3g} {equal!s:>5}")
            if is_cuda:
                # floor: p (and q) at each request's final row, read once
                floor_bytes = batch * vocab_size * 4 * (2 if has_draft_probs else 1)
                line += f"  {floor_bytes / tri_s / 1e9:>11.0f}  {floor_bytes / peak / 1e6:>8.3f}"
            print(line)


if __name__ == "__main__":
    main()
