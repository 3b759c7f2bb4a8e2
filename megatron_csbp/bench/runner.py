"""Run every world of the benchmark and aggregate per case (max over ranks where a step waits
for the slowest rank, per-rank lists for memory)."""
from __future__ import annotations

import os
import platform
import time
from contextlib import suppress
from dataclasses import asdict
from typing import Dict, List

import torch

from megatron_csbp.bench.cases import (BenchConfig, Case, DiffusionGemmaBenchModel, cases_for, dg_cases_for,
                                      formula_bytes_per_layer, formula_bytes_sent)
from megatron_csbp.bench.report import by_case
from megatron_csbp.bench.worker import world_main
from megatron_csbp.parallel.spawn import spawn


#: what each rank measures of its steps' time beside the wall time (`bench.worker`), kept per rank
TIMING_KEYS = ("exposed_comm_s", "in_flight_comm_s", "thread_cpu_s", "process_cpu_s", "transfers",
               "forward_in_flight_comm_s", "forward_exposed_comm_s")


def aggregate(cfg: BenchConfig, per_rank: List[List[Dict]]) -> List[Dict]:
    """per_rank[r] is rank r's list of case records (same order on every rank)."""
    rows = []
    for records in zip(*per_rank):
        first = records[0]
        case = Case(*(first[k] for k in ("case", "cp", "bp", "transport", "schedule")), first.get("attention"))
        if case.shard_group_size != len(records):
            raise RuntimeError(f"case {case.name} of {case.shard_group_size} ranks came back from {len(records)} ranks")
        L, t = first["seq_length"], first["median_step_s"]  # t: already the max over ranks, per step

        def each(key: str) -> list:  # the records' values of `key`, rank by rank
            return [r[key] for r in records]

        sent, peak, rss = each("attn_bytes_sent"), each("peak_tensor_bytes"), each("rss_high_water_bytes")
        row = {
            "case": case.name, "kind": case.kind, "P": case.shard_group_size, "cp": case.cp, "bp": case.bp,
            "transport": case.transport, "schedule": case.schedule, "seq_length": L, "median_step_s": t,
            "step_times_s": first["step_times_s"], "tokens_per_s": cfg.model.micro_batch_size * L / t,
            "loss_step0": first["loss_step0"], "rows_per_rank": each("rows"),
            "attn_bytes_sent_per_rank": sent, "attn_bytes_sent": max(sent),
            "attn_bytes_received": max(each("attn_bytes_received")),
            "attn_bytes_per_layer_rank0": {str(k): v for k, v in first["attn_bytes_per_layer"].items()},
            "formula_bytes_sent": formula_bytes_sent(case, cfg.model, L),
            "peak_tensor_bytes_per_rank": peak, "peak_tensor_bytes": None if None in peak else max(peak),
            "static_tensor_bytes_per_rank": each("static_tensor_bytes"),
            "rss_high_water_bytes_per_rank": rss, "rss_high_water_bytes": None if None in rss else max(rss),
            "baseline": case.baseline_name(),
            # the slowest rank's median seconds waiting on attention collectives per step
            "exposed_comm_s": max(each("exposed_comm_s")) if all("exposed_comm_s" in r for r in records) else None,
        }
        if all("in_flight_comm_s" in r for r in records):
            inflight, exposed = each("in_flight_comm_s"), each("exposed_comm_s")
            row.update(
                timing_per_rank=[{k: r[k] for k in TIMING_KEYS} for r in records],
                in_flight_comm_s=max(inflight),
                # over all ranks: the share of the time transfers were in flight that compute covered
                hidden_comm_share=(1.0 - sum(exposed) / sum(inflight)) if sum(inflight) > 0 else None,
                transfers=sum(each("transfers")),
                # CPU seconds of a rank's step (robust to other jobs sharing the cores): the largest rank
                thread_cpu_s=max(each("thread_cpu_s")), process_cpu_s=max(each("process_cpu_s")))
        if case.attention is not None:
            row["attention"] = case.attention
            row["formula_bytes_per_layer"] = {str(k): v for k, v in
                                              formula_bytes_per_layer(case, cfg.model, L).items()}
            row["attn_bytes_sent_per_layer_per_rank"] = [
                {str(k): sum(v for key, v in per.items() if key.endswith("_sent"))
                 for k, per in r["attn_bytes_per_layer"].items()} for r in records]
        rows.append(row)
    return rows


def add_ratios(rows: List[Dict]) -> None:
    index = by_case(rows)
    for r in rows:
        base = index.get((r["P"], r["seq_length"], r["baseline"]))  # None: a single rank's (no baseline)
        for key, out in (("median_step_s", "time_vs_cp"), ("attn_bytes_sent", "traffic_vs_cp"),
                         ("peak_tensor_bytes", "memory_vs_cp"), ("tokens_per_s", "throughput_vs_cp"),
                         ("thread_cpu_s", "cpu_vs_cp")):
            r[out] = None if base is None or not base.get(key) or r.get(key) is None else r[key] / base[key]


def load_average():
    """os.getloadavg(), None where the platform has none."""
    with suppress(AttributeError, OSError):
        return os.getloadavg()


def environment() -> Dict:
    return {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "host_cpus": os.cpu_count(),
            "load_average_at_start": load_average(), "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "threads_per_rank": 1, "backend": "gloo"}


def run(cfg: BenchConfig, log=print) -> Dict:
    cfg.check()
    env = environment()
    per_world = []
    t0 = time.perf_counter()
    for P in (1,) + tuple(cfg.sizes):
        cases = dg_cases_for(P) if isinstance(cfg.model, DiffusionGemmaBenchModel) else cases_for(P, cfg.layouts)
        log(f"[bench] world of {P} rank(s): {', '.join(c.name for c in cases)} at L = {list(cfg.seq_lengths)}")
        tw = time.perf_counter()
        per_rank = spawn(world_main, P, cfg, cases)
        log(f"[bench]   done in {time.perf_counter() - tw:.1f} s")
        per_world.extend(aggregate(cfg, per_rank))
    add_ratios(per_world)
    env["wall_s"] = time.perf_counter() - t0
    end_load = load_average()
    if end_load is not None:
        env["load_average_at_end"] = end_load
    return {"config": asdict(cfg), "environment": env, "rows": per_world}
