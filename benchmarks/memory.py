"""Child process of the memory suite: measures peak memory of the given modes, prints one JSON line.

    python -m benchmarks.memory '{"modes": ["inference", "es"], "model": "tiny", "device": "cpu", ...}'

Modes: "inference" (one generate call on the batch), "es" (one fastes ES iteration in the default eval
mode on the same batch) and "es-<eval mode>". On CPU the figure is the process's peak resident set
(VmHWM, i.e. getrusage's ru_maxrss without the part inherited at exec, see peak_rss_bytes; tracemalloc
does not see torch's allocations); on CUDA it is
torch.cuda.max_memory_allocated. After setup (model loaded, one warm-up generate) the high-water mark is
reset (Linux: /proc/self/clear_refs), so import-time transients do not hide the work's own peak; the
suite runs one mode per process, the quick mode several in one process, one after another.
"""

from __future__ import annotations

import gc
import json
import sys

import torch

from benchmarks.common import (
    IterationSetting,
    current_rss_bytes,
    load_bench_model,
    make_run,
    peak_rss_bytes,
    reset_peak_rss,
    ru_maxrss_bytes,
)


def measure(spec: dict) -> dict[str, dict]:
    from fastes.models.generation import generate
    from fastes.run.es_loop import es_iteration
    from fastes.run.shared import batch_for

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    device = torch.device(spec["device"])
    cuda = device.type == "cuda"
    bench = load_bench_model(spec["model"], device, getattr(torch, spec["dtype"]))
    setting = IterationSetting(spec["population"], spec["batch"], spec["max_new_tokens"])
    runs = {}
    for mode in spec["modes"]:
        eval_mode = mode.split("-", 1)[1] if mode.startswith("es-") else None
        runs[mode] = make_run(bench, setting, spec["backend"], eval_mode)
    run = next(iter(runs.values()))[0]
    prompts = run.prompts(batch_for(run, "es", 0))
    generate(bench.model, bench.tokenizer, prompts[:1], max_new_tokens=2)  # lazy allocations happen here
    weights = sum(p.numel() * p.element_size() for p in bench.model.parameters())

    results = {}
    for mode, (run, es) in runs.items():
        gc.collect()
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            setup_cuda = torch.cuda.memory_allocated(device)
        lifetime_peak = peak_rss_bytes()
        was_reset = reset_peak_rss()
        setup_rss = current_rss_bytes()

        if mode == "inference":
            generate(bench.model, bench.tokenizer, prompts, max_new_tokens=setting.max_new_tokens)
        else:
            es_iteration(run, es, 0)

        result = {
            "peak_rss_bytes": peak_rss_bytes(),
            "ru_maxrss_bytes": ru_maxrss_bytes(),
            "setup_rss_bytes": setup_rss,
            "lifetime_peak_rss_bytes_before": lifetime_peak,
            "peak_reset": was_reset,
            "weights_bytes": weights,
            "evolved_bytes": bench.nbytes,
        }
        if cuda:
            torch.cuda.synchronize(device)
            result.update(
                metric="cuda_max_memory_allocated",
                peak_bytes=torch.cuda.max_memory_allocated(device),
                setup_bytes=setup_cuda,
            )
        else:
            result.update(metric="peak_rss", peak_bytes=result["peak_rss_bytes"], setup_bytes=setup_rss)
        results[mode] = result
    return results


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m benchmarks.memory '<json spec>'")
    print(json.dumps(measure(json.loads(argv[0]))))


if __name__ == "__main__":
    main()
