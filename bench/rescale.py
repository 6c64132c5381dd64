"""Rescale benchmark: ResNet-18 on synthetic 32x32 images, resized 2 -> 4 -> 1
worker slots, against the same job never resized (2 slots throughout).

Measures what a resize costs and checks it changes nothing:
- rescale_s: stop seen at an iteration boundary -> checkpoint saved -> workers
  exit -> new workers start -> checkpoint loaded -> ready for the first new
  iteration (mean over the two resizes);
- save_s / load_s: checkpoint save and restore (means over the resizes);
- start_s: process start to ready (process group up, data and model built) of
  the relaunched segments (mean); their workers are standbys that imported torch
  while the previous segment trained (see flows/training/coordinator/launcher.py), so this
  is hand-over to ready. cold_start_s is the same for the first segment, whose
  workers start from nothing;
- max_loss_rel_diff: largest relative difference between the two runs' losses
  at the same iteration;
- inplace_rescale_s, inplace_max_loss_rel_diff: the same job resized in place
  (issue 26: the ranks that stay keep their state, newcomers get it by
  broadcast, nothing saved or loaded), in the same process, so on the same
  machine at the same moment; inplace_ratio = inplace_rescale_s / rescale_s.
Goals: rescale_s <= 2 x (save_s + load_s) + start_s; max_loss_rel_diff <= 1e-3;
save_s < 1 s; inplace_ratio <= 0.25 and inplace_max_loss_rel_diff <= 1e-3.
Prints a few lines, then one JSON object as the last line.
Run: .venv/bin/python bench/rescale.py [--device cuda] [--deterministic]
(--deterministic: every run with deterministic kernels only, the
`deterministic` hyperparameter; on GPU, run with and without it to see what
the kernels' own non-determinism adds to the loss differences, and the cost
in wall time)
(on CUDA, NCCL wants one rank per GPU: the plan is half the GPUs -> all -> one,
so at least 2 GPUs; the same figures, with NCCL communicators re-formed and
the survivors' CUDA contexts kept)
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flows.training.params import TrainParameters  # noqa: E402
from flows.training.coordinator.runtime import TrainResult, run_training  # noqa: E402

# Segments long enough for the standby workers of the next GPU set to finish
# importing torch in the background, as they would in a real job.
ITERATIONS = 18
SWITCH_AT = [9, 13]  # the first long enough for the 4-slot set's standbys to import torch (a shrink needs none)
PLAN = [[0, 1], [0, 1, 2, 3], [0]]


def plan_for(device: str) -> list[list[int]]:
    if device == "cpu":
        return PLAN
    import torch

    count = torch.cuda.device_count()
    if count < 2:
        raise SystemExit(f"--device cuda needs at least 2 GPUs (NCCL: one rank per GPU); {count} here")
    return [list(range(count // 2)), list(range(count)), [0]]


def train(plan: list[list[int]], switch_at: list[int], root: Path, key: str,
          in_place: bool = False, device: str = "cpu", ray_address: str | None = None,
          deterministic: bool = False) -> tuple[TrainResult, float]:
    params = TrainParameters(
        model="resnet",
        dataset={"name": "synthetic-images", "options": {"size": 256}},
        hyperparameters={"global_batch_size": 16, "learning_rate": 0.001, "momentum": 0.9,
                         "deterministic": deterministic},
        iterations=ITERATIONS,
        gpu_plan=plan,
        switch_at=switch_at,
        checkpoint_interval=1000,  # only the rescale checkpoints: that is what is measured
        checkpoint_store=str(root / "checkpoints"),
        control_dir=str(root / "control"),
        device=device,  # type: ignore[arg-type]
        resize_in_place=in_place,
        ray_address=ray_address,
    )
    start = time.perf_counter()
    result = run_training(params, key)
    return result, time.perf_counter() - start


def measure(device: str = "cpu", ray_address: str | None = None, deterministic: bool = False) -> dict:
    """The figures of one run of the benchmark (on a Ray cluster's actors
    with `ray_address`: bench/ray.py), as the JSON line prints them."""
    plan = plan_for(device)
    with tempfile.TemporaryDirectory(prefix="elasticflow-bench-") as tmp:
        root = Path(tmp)
        resized, resized_wall = train(plan, SWITCH_AT, root, "resized", device=device, ray_address=ray_address,
                                      deterministic=deterministic)
        in_place, in_place_wall = train(plan, SWITCH_AT, root, "in-place", in_place=True, device=device,
                                        ray_address=ray_address, deterministic=deterministic)
        steady, steady_wall = train([plan[0]], [], root, "steady", device=device, deterministic=deterministic)
    assert resized.status == steady.status == in_place.status == "completed", (resized.status, steady.status)
    assert [r.how for r in in_place.rescales] == ["in_place"] * len(SWITCH_AT), in_place.rescales
    in_place_rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(in_place.losses, steady.losses)]
    assert len(resized.losses) == len(steady.losses) == ITERATIONS
    rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(resized.losses, steady.losses)]
    relaunched = resized.segments[1:]
    rescale = [r.seconds for r in resized.rescales if r.seconds is not None]
    saves = [s for seg in resized.segments[:-1] for s in seg.timings.save_s]
    loads = [seg.timings.load_s for seg in relaunched]
    starts = [seg.timings.ready_t - seg.timings.launch_t for seg in relaunched]
    first = resized.segments[0].timings
    to_first = [
        seg.timings.first_iteration_t - (prev.timings.stop_seen_t or max(prev.timings.iteration_end_t.values()))
        for prev, seg in zip(resized.segments, relaunched)
        if seg.timings.first_iteration_t
    ]
    summary = {
        "rescale_s": statistics.mean(rescale),
        "save_s": statistics.mean(saves),
        "load_s": statistics.mean(loads),
        "start_s": statistics.mean(starts),
        "cold_start_s": first.ready_t - first.launch_t,
        "max_loss_rel_diff": max(rel),
        "loss_rel_diff_each": [float(f"{r:.2e}") for r in rel],
        "rescale_to_first_iteration_end_s": statistics.mean(to_first),
        "rescales": [
            {"from": r.from_gpus, "to": r.to_gpus, "at": r.iteration, "seconds": r.seconds} for r in resized.rescales
        ],
        "start_s_each": starts,
        "inplace_rescale_s": statistics.mean(r.seconds for r in in_place.rescales if r.seconds is not None),
        "inplace_max_loss_rel_diff": max(in_place_rel),
        "inplace_rescales": [
            {"from": r.from_gpus, "to": r.to_gpus, "at": r.iteration, "seconds": r.seconds} for r in in_place.rescales
        ],
        "inplace_wall_s": in_place_wall,
        "resized_wall_s": resized_wall,
        "steady_wall_s": steady_wall,
        "iterations": ITERATIONS,
        "deterministic": deterministic and all(s.deterministic for s in resized.segments + steady.segments),
        "final_loss": resized.losses[-1],
        "first_loss": resized.losses[0],
    }
    budget = 2 * (summary["save_s"] + summary["load_s"]) + summary["start_s"]
    summary["goal_rescale"] = summary["rescale_s"] <= budget
    summary["goal_loss"] = summary["max_loss_rel_diff"] <= 1e-3
    summary["goal_save"] = summary["save_s"] < 1.0
    summary["inplace_ratio"] = summary["inplace_rescale_s"] / summary["rescale_s"]
    summary["goal_inplace"] = summary["inplace_ratio"] <= 0.25 and summary["inplace_max_loss_rel_diff"] <= 1e-3
    summary["budget_s"] = budget
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--deterministic", action="store_true", help="deterministic kernels only (docs/training.md)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    summary = measure(args.device, deterministic=args.deterministic)
    budget = summary["budget_s"]
    for r in summary["rescales"]:
        print(f"rescale {r['from']} -> {r['to']} at iteration {r['at']}: {r['seconds']:.2f} s")
    print(
        f"start {summary['start_s']:.2f} s (cold {summary['cold_start_s']:.2f} s), save {summary['save_s']:.3f} s, load {summary['load_s']:.3f} s; budget {budget:.2f} s"
    )
    print(
        f"loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}; max relative difference {summary['max_loss_rel_diff']:.2e}"
    )
    for r in summary["inplace_rescales"]:
        print(f"in place {r['from']} -> {r['to']} at iteration {r['at']}: {r['seconds']:.2f} s")
    print(f"in place / restart: {summary['inplace_ratio']:.2f}; in-place max relative loss difference "
          f"{summary['inplace_max_loss_rel_diff']:.2e}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
