"""Validation against the real cluster: rebuild the workload of a recorded `kvpool bench policies`
or `kvpool bench disagg` run (same seeds, same Poisson arrivals, the prompts tokenized as the
router tokenizes them), simulate it with the `local` profile, and set the simulator's mean TTFT
and TPOT next to what the real cluster measured.

`tokenize(messages) -> token ids` is passed in (the CLI builds it from the reference model's
tokenizer and chat template), so this module needs no model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Callable

from kvpool.tools.bench.serve_client import poisson_offsets
from kvpool.tools.bench.workloads import Request, chat_requests, mixed_requests
from kvpool.errors import InvalidArgument
from kvpool.tools.sim.engine import SimConfig
from kvpool.tools.sim.profile import Profile
from kvpool.tools.sim.workload import Workload, from_token_lists

Tokenize = Callable[[list[dict[str, str]]], list[int]]
POLICY_ORDER = ("round_robin", "least_loaded", "cache_aware")  # the bench's run order (seeds)


@dataclass
class Case:
    label: str
    rate: float
    workload: Workload
    config: SimConfig
    real: dict[str, float | None]  # ttft_mean_ms, tpot_mean_ms, tpot_p99_ms, mean_cached_tokens


def _workload(reqs: list[Request], rate: float, tokenize: Tokenize, chunk_tokens: int) -> Workload:
    arrivals = poisson_offsets(len(reqs), rate, seed=int(rate * 1000))
    prompts = [tokenize(r.chat_messages()) for r in reqs]
    return from_token_lists(prompts, [r.max_tokens for r in reqs], arrivals, chunk_tokens)


def cases(doc: dict[str, Any], tokenize: Tokenize, profile: Profile, chunk_tokens: int = 256,
          host_cores: int = 0) -> list[Case]:
    """The runs of a recorded bench JSON document, ready to simulate (`host_cores`: the cores the
    real workers shared, 0 to ignore contention)."""
    notes = " ".join(doc.get("notes", []))
    by_case = {r["case"]: r for r in doc.get("results", [])}
    out: list[Case] = []
    if doc.get("bench") == "policies":
        m = re.search(r"(\d+) prefill \+ (\d+) decode.*?(\d+) conversations x (\d+) rounds, system prompt (\d+) words",
                      notes)
        if not m:
            raise InvalidArgument("policies document without its setup note")
        if "scenario local-caches" in notes:  # per-worker cache sizes and a small pool: not modelled here
            raise InvalidArgument("a `bench policies --workload local-caches` run is not rebuilt by sim validate "
                                  "(it replays the shared-pool scenario only)")
        n_p, n_d, convs, rounds, system_len = (int(x) for x in m.groups())
        rates = sorted({float(c.split("@")[1]) for c in by_case if c.startswith("ttft_mean/")})
        for r_i, rate in enumerate(rates):
            for p_i, policy in enumerate(POLICY_ORDER):
                row = by_case.get(f"ttft_mean/{policy}@{rate:g}")
                if row is None:
                    continue
                reqs = chat_requests(convs, rounds, 2, system_len, 48, 16, seed=100 * r_i + p_i)
                extra = row.get("extra") or {}
                out.append(Case(policy, rate, _workload(reqs, rate, tokenize, chunk_tokens),
                                SimConfig(prefill=n_p, decode=n_d, profile=profile, policy=policy, host_cores=host_cores),
                                {"ttft_mean_ms": extra.get("ttft_mean_ms"), "tpot_mean_ms": extra.get("tpot_mean_ms"),
                                 "tpot_p99_ms": extra.get("tpot_p99_ms"),
                                 "mean_cached_tokens": extra.get("mean_cached_tokens")}))
    elif doc.get("bench") == "disagg":
        setup = doc.get("setup")
        if not setup:
            raise InvalidArgument("disagg document without its setup (recorded before the bench wrote one)")
        if setup.get("engine", "reference") != "reference":
            raise InvalidArgument("only runs of the reference engine are simulated (the local profile is its own)")
        p_split, d_split = setup["split"]
        shapes = {"colocated": (0, 0, setup["workers"], 0), "disaggregated": (p_split, d_split, 0, 0),
                  "disagg+conditional": (p_split, d_split, 0, 256)}
        prof = replace(profile, prefill_chunk_tokens=setup["chunk_tokens"])
        cores = 0 if setup.get("cpus_per_worker") else host_cores  # pinned workers: nothing shared
        for r_i, rate in enumerate(setup["rates"]):
            reqs = mixed_requests(setup["num_requests"], setup["long_fraction"], int(setup["long_len"]),
                                  int(setup["short_len"]), int(setup["output_len"]), setup["range_ratio"], seed=r_i)
            work = _workload(reqs, rate, tokenize, chunk_tokens)
            for name, (n_p, n_d, n_c, local) in shapes.items():
                row = by_case.get(f"ttft_mean_ms/{name}@{rate:g}")
                if row is None:
                    continue
                out.append(Case(name, rate, work,
                                SimConfig(prefill=n_p, decode=n_d, colocated=n_c, profile=prof,
                                          local_prefill_tokens=local, host_cores=cores),
                                {"ttft_mean_ms": row["value"], "tpot_mean_ms": None,
                                 "tpot_p99_ms": by_case[f"tpot_p99_ms/{name}@{rate:g}"]["value"],
                                 "mean_cached_tokens": None}))
    else:
        raise InvalidArgument(f"can validate against 'policies' or 'disagg' documents, not {doc.get('bench')!r}")
    return out


def compare(case: Case, summary: dict[str, Any]) -> dict[str, Any]:
    """One table row: real vs simulated, with sim/real ratios."""
    def ratio(sim_v: float | None, real_v: float | None) -> float | None:
        return round(sim_v / real_v, 3) if sim_v is not None and real_v else None

    sim = {"ttft_mean_ms": summary["ttft_ms"]["mean"], "tpot_mean_ms": summary["tpot_ms"]["mean"],
           "tpot_p99_ms": summary["tpot_ms"]["p99"],
           "mean_cached_tokens": round(summary["token_hit_ratio"] * sum(r.prompt_tokens for r in case.workload.requests)
                                       / len(case.workload), 1)}
    return {"case": case.label, "rate": case.rate, "real": case.real, "sim": sim,
            "ratio": {k: ratio(sim[k], case.real.get(k)) for k in sim}}
