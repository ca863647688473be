"""Workload files and presets (issue 26): `--workload NAME|FILE`, `--set KEY=VALUE` and the flags
that override them, through the real click commands (`--dry-run` prints what a run would use).

The equivalence tests pin each documented command line (BENCHMARKS.md, RELIABILITY.md, README,
the tests) to the parameters the old flags gave; the expected values are the old flags'
defaults and the old WORKLOADS / SCENARIOS tables, copied here from the code they replace."""

from __future__ import annotations

import tomllib
import pytest
from click.testing import CliRunner

from kvpool.cli import cli
from kvpool.tools.workload_file import WorkloadFile, all_presets, resolve

T = "/work/shared/data/traces/conversation_trace.jsonl"


def dry(*args: str) -> dict:
    """What `kvpool ARGS --dry-run` resolves, as a dict (its TOML output parsed back)."""
    r = CliRunner().invoke(cli, [*args, "--dry-run"])
    assert r.exit_code == 0, r.output
    return tomllib.loads(r.output)


def fails(*args: str) -> str:
    r = CliRunner().invoke(cli, [*args, "--dry-run"])
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)  # a usage error, not a traceback
    return r.output


def schemas() -> dict[str, list[type[WorkloadFile]]]:
    from kvpool.tools.chaos.command import ChaosWorkload
    from kvpool.tools.sim.command import PlanWorkload, RunWorkload, StudyWorkload
    from kvpool.tools.bench.disagg import DisaggWorkload
    from kvpool.tools.bench.engine import EngineWorkload
    from kvpool.tools.bench.policies import PoliciesWorkload
    from kvpool.tools.bench.pool import PoolWorkload
    from kvpool.tools.bench.serve import ServeWorkload

    return {"bench serve": [ServeWorkload], "bench disagg": [DisaggWorkload], "bench engine": [EngineWorkload],
            "bench pool": [PoolWorkload], "bench policies": [PoliciesWorkload], "chaos": [ChaosWorkload],
            "sim": [RunWorkload, PlanWorkload, StudyWorkload]}


# --- every preset ----------------------------------------------------------------------------

def test_every_preset_is_valid_for_every_command_that_takes_it():
    found = all_presets()
    assert set(found) == set(schemas())
    for command, table in found.items():
        assert table, command
        for name, data in table.items():
            assert data.get("description"), f"{command} {name}: say what it is"
            for schema in schemas()[command]:  # the sim presets serve sim, sim plan and sim study
                w = resolve(command, schema, name)
                assert w.source == name and all(getattr(w, k) == v for k, v in data.items()), (command, name)


def test_presets_listing_and_help_explain_them():
    r = CliRunner().invoke(cli, ["bench", "presets"])
    assert r.exit_code == 0, r.output
    for command, table in all_presets().items():
        assert f"kvpool {command} --workload NAME" in r.output
        for name, data in table.items():
            assert f"  {name}: {data['description']}" in r.output
    assert 'clients=[1, 4, 16, 64], sizes=["64KiB", "1MiB"], reps=3' in r.output  # what a preset sets
    only = CliRunner().invoke(cli, ["bench", "presets", "serve"])
    assert "bench serve" in only.output and "bench pool" not in only.output
    for args in (["bench", "serve"], ["bench", "disagg"], ["sim", "plan"], ["chaos"]):
        text = CliRunner().invoke(cli, [*args, "--help"]).output
        assert "Presets:" in text and "Keys (default):" in text and "--workload" in text, args
    serve_help = CliRunner().invoke(cli, ["bench", "serve", "--help"]).output
    assert "long-prefix" in serve_help and "system_len = 512" in serve_help


# --- equivalence with the old flags ---------------------------------------------------------

OLD_DISAGG_WORKLOADS = {  # kvpool/tools/bench/disagg.py WORKLOADS before issue 26
    "mixed": {"long_fraction": 0.3, "long_len": 1500, "short_len": 150, "output_len": 64, "range_ratio": 0.1},
    "short": {"long_fraction": 0.0, "long_len": 0, "short_len": 150, "output_len": 64, "range_ratio": 0.5},
    "long": {"long_fraction": 1.0, "long_len": 1500, "short_len": 0, "output_len": 64, "range_ratio": 0.1},
    "smoke": {"long_fraction": 0.5, "long_len": 300, "short_len": 40, "output_len": 6, "range_ratio": 0.1},
}


def test_bench_disagg_seed_table_line_and_old_workloads():
    # BENCHMARKS.md: `kvpool bench disagg --json --plot P`: the old defaults
    old = {"workers": 2, "split": "half", "cpus_per_worker": 1, "num_requests": 30, "rate": [0.1, 0.2, 0.3, 0.4],
           "chunk_tokens": 256, "goodput": ["ttft:10000", "tpot:300"], "configs": [], **OLD_DISAGG_WORKLOADS["mixed"]}
    assert dry("bench", "disagg") == old
    assert {k: v for k, v in dry("bench", "disagg", "--workload", "mixed").items() if k != "description"} == old
    from kvpool.tools.bench.disagg import shape_of

    for name, shape in OLD_DISAGG_WORKLOADS.items():
        assert shape_of(name) == shape
    # tests/e2e/test_bench_cluster.py's line, unchanged: the flags win over the smoke preset
    got = dry("bench", "disagg", "--config", "colocated", "--config", "disagg+conditional", "--num-requests", "4",
              "--workload", "smoke", "--rate", "4")
    assert got["configs"] == ["colocated", "disagg+conditional"] and got["num_requests"] == 4 and got["rate"] == [4.0]
    assert {k: got[k] for k in OLD_DISAGG_WORKLOADS["smoke"]} == OLD_DISAGG_WORKLOADS["smoke"]


def test_bench_engine_line():
    # BENCHMARKS.md: `kvpool bench engine --json`: --batches 1,4,8,16,32 --context 800 --new-tokens 8
    # --reps 3 --threads 1 --pack 16,64,256,512
    old = {"batches": [1, 4, 8, 16, 32], "context": 800, "new_tokens": 8, "reps": 3, "threads": 1,
           "pack": [16, 64, 256, 512]}
    assert dry("bench", "engine") == old
    assert {k: v for k, v in dry("bench", "engine", "-w", "batching").items() if k != "description"} == old
    assert dry("bench", "engine", "--threads", "2", "--set", "pack=")["pack"] == []


def test_bench_pool_lines():
    defaults = {"sizes": ["64KiB", "1MiB", "8MiB"], "bytes_per_rep": "8MiB", "min_ops": 16, "reps": 21, "batch": 16,
                "peers": ["redis", "mooncake"], "put": True, "engine": True, "clients": [], "duration": 2.0,
                "readers": False, "server_cpus": "", "client_cpus": "", "auth": False, "netns": False, "rtt_ms": 1.0, "link_rate": "10gbit", "loss_pct": 0.0}
    assert dry("bench", "pool") == defaults  # `kvpool bench pool --json`
    many = dry("bench", "pool", "--workload", "many-clients")  # `--clients 1,4,16,64 --sizes 64KiB,1MiB --reps 3`
    assert many == {**defaults, "description": many["description"], "clients": [1, 4, 16, 64],
                    "sizes": ["64KiB", "1MiB"], "reps": 3, "readers": True}
    auth = dry("bench", "pool", "--workload", "auth")  # `kvpool bench pool --auth`
    assert auth == {**defaults, "description": auth["description"], "auth": True}
    bisect = dry("bench", "pool", "-w", "bisect")  # `--sizes 64KiB --peers redis --no-engine --reps 7 --json`
    assert bisect == {**defaults, "description": bisect["description"], "sizes": ["64KiB"], "peers": ["redis"],
                      "engine": False, "reps": 7}
    assert dry("bench", "pool", "--peers", "")["peers"] == []
    netns = dry("bench", "pool", "-w", "netns")  # RELIABILITY.md: was `--netns --rtt-ms 1 --rate 10gbit`
    assert netns == {**defaults, "description": netns["description"], "netns": True}


def test_bench_policies_local_caches_line():
    # BENCHMARKS.md: `kvpool bench policies --scenario local-caches --rate R --json`, old SCENARIOS
    got = dry("bench", "policies", "--workload", "local-caches", "--rate", "0.25")
    old = {"prefill": 2, "decode": 1, "conversations": 7, "rounds": 4, "system_prompts": 0, "system_len": 500,
           "output_len": 16, "pool_dram": "128MiB", "pool_eviction": "lru", "local_cache": "128MiB",
           "rate": [0.25], "goodput": ["ttft:2000", "tpot:150"]}
    assert {k: v for k, v in got.items() if k != "description"} == old
    shared = dry("bench", "policies")  # the shared-pool scenario: pool and caches at their defaults (unset)
    assert shared["conversations"] == 6 and shared["system_prompts"] == 2 and shared["system_len"] == 600
    assert "pool_dram" not in shared and "local_cache" not in shared and shared["rate"] == [1.0]


def test_bench_serve_lines_give_the_same_requests():
    from kvpool.tools.bench.serve import ServeWorkload, build_workload
    from kvpool.tools.bench.workloads import chat_requests

    # README: `kvpool bench serve --base-url URL --workload chat --rate 0.5,1,2`
    readme = dry("bench", "serve", "--workload", "chat", "--rate", "0.5,1,2")
    assert readme["rate"] == [0.5, 1.0, 2.0]
    w = resolve("bench serve", ServeWorkload, "chat", flags={"rate": "0.5,1,2"})
    assert build_workload(w, w.seed) == chat_requests(8, 3, 2, 512, 48, 64, seed=0)
    assert build_workload(w, w.seed + 1, num_requests=w.warmup) == chat_requests(1, 3, 2, 512, 48, 64, seed=1)[:2]
    # the e2e line: old --num-requests 6 --output-len 16 --system-len 700 --system-prompts 1 --max-concurrency 1
    w = resolve("bench serve", ServeWorkload, "chat", ["output_len=16", "system_len=700", "system_prompts=1",
                                                       "max_concurrency=1"], {"num_requests": 6, "rate": "inf"})
    assert build_workload(w, w.seed) == chat_requests(2, 3, 1, 700, 48, 16, seed=0)
    assert w.max_concurrency == 1 and w.rate == [float("inf")]
    assert dry("bench", "serve")["kind"] == "random" and dry("bench", "serve")["rate"] == [float("inf")]


def test_sim_and_chaos_lines():
    # docs/sim.md: `kvpool sim --trace T --prefill 16 --decode 16 --json`
    got = dry("sim", "--trace", T, "--prefill", "16", "--decode", "16")
    assert (got["trace"], got["prefill"], got["decode"], got["colocated"], got["dram"]) == (T, 16, 16, 0, "unlimited")
    assert (got["profile"], got["policy"], got["eviction"], got["ssd"], got["slo_tbt_ms"]) == (
        "h100-llama3-8b", "cache_aware", "lru", "0", 100.0)
    # benchmarks/sim-tight-tbt-slo.json: `... --slo-tbt-ms 50 --goodput-steps 7`
    tight = dry("sim", "--trace", T, "--colocated", "32", "-w", "tight-tbt", "--set", "goodput_steps=7")
    assert tight["slo_tbt_ms"] == 50.0 and tight["goodput_steps"] == 7 and tight["colocated"] == 32
    plan = dry("sim", "plan", "--trace", T, "--mix", "8P/24D,16P/16D,32c", "--dram", "256GiB,1TiB")
    assert plan["mix"] == ["8P/24D", "16P/16D", "32c"] and plan["dram"] == ["256GiB", "1TiB"]
    # RELIABILITY.md: `kvpool chaos --seed 1 --duration 600`: the old defaults
    assert dry("chaos", "--seed", "1", "--duration", "600") == {"seed": 1, "duration": 600.0, "min_faults": 100,
                                                                 "clients": 4, "rate": 25.0}


# --- precedence, files, errors -------------------------------------------------------------

def test_a_flag_overrides_set_which_overrides_the_file(tmp_path):
    f = tmp_path / "load.toml"
    f.write_text('kind = "docqa"\nnum_requests = 5\nrate = [2]\ndoc_len = 300\n')
    assert dry("bench", "serve", "-w", str(f))["num_requests"] == 5
    got = dry("bench", "serve", "-w", str(f), "--set", "num_requests=7", "--set", "doc_len=100")
    assert (got["num_requests"], got["doc_len"], got["rate"], got["kind"]) == (7, 100, [2.0], "docqa")
    got = dry("bench", "serve", "-w", str(f), "--set", "num_requests=7", "--num-requests", "9", "--rate", "3,inf")
    assert (got["num_requests"], got["rate"]) == (9, [3.0, float("inf")])
    # the preset's own keys give way too: burst sets 256 requests
    assert dry("bench", "serve", "-w", "burst", "--num-requests", "10")["num_requests"] == 10


def test_dry_run_output_is_a_workload_file_that_reads_back(tmp_path):
    first = CliRunner().invoke(cli, ["bench", "serve", "-w", "long-prefix", "--set", 'extra_body={ignore_eos = true}',
                                     "--set", "goodput=ttft:2000,tpot:100", "--dry-run"]).output
    (tmp_path / "again.toml").write_text(first)
    again = CliRunner().invoke(cli, ["bench", "serve", "-w", str(tmp_path / "again.toml"), "--dry-run"]).output
    assert again == first and tomllib.loads(first)["extra_body"] == {"ignore_eos": True}


def test_relative_trace_in_a_file_is_relative_to_the_file(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "t.jsonl").write_text("")
    (tmp_path / "sub" / "w.toml").write_text('kind = "trace"\ntrace = "t.jsonl"\n')
    assert dry("bench", "serve", "-w", str(tmp_path / "sub" / "w.toml"))["trace"] == str(tmp_path / "sub" / "t.jsonl")


def test_yaml_file_works_like_toml(tmp_path):
    pytest.importorskip("yaml")
    f = tmp_path / "w.yaml"
    f.write_text("sizes: [64KiB]\nreps: 2\npeers: [redis]\n")
    got = dry("bench", "pool", "-w", str(f))
    assert (got["sizes"], got["reps"], got["peers"]) == (["64KiB"], 2, ["redis"])
    f.write_text("sizes: [64KiB]\nrepz: 2\n")
    out = fails("bench", "pool", "-w", str(f))
    assert "unknown key 'repz'" in out and "did you mean 'reps'" in out and str(f) in out


def test_unknown_keys_and_bad_values_are_clear_errors(tmp_path):
    f = tmp_path / "w.toml"
    f.write_text('kind = "chat"\nsytem_len = 700\n')
    out = fails("bench", "serve", "-w", str(f))
    assert f"workload file {f}: unknown key 'sytem_len' (did you mean 'system_len'?)" in out
    assert "Known keys of kvpool bench serve:" in out and "Traceback" not in out
    assert "--set: unknown key 'colour'" in fails("bench", "disagg", "--set", "colour=red")
    assert "--set 'rounds': expected KEY=VALUE" in fails("bench", "serve", "--set", "rounds")
    assert "key 'rounds'" in fails("bench", "serve", "--set", "rounds=many")
    assert "--rate: key 'rate'" in fails("bench", "serve", "--rate", "0,1")
    assert "key 'workers'" in fails("bench", "disagg", "--set", "workers=1")
    assert "unknown workload 'chatt'" in fails("bench", "serve", "-w", "chatt") and "did you mean 'chat'" in fails(
        "bench", "serve", "-w", "chatt")
    assert "workload file not found" in fails("bench", "engine", "-w", str(tmp_path / "none.toml"))
    (tmp_path / "bad.toml").write_text("reps = \n")
    assert "not valid TOML" in fails("bench", "engine", "-w", str(tmp_path / "bad.toml"))
    # a preset of one command is no preset of another
    assert "unknown workload 'many-clients' for kvpool bench serve" in fails("bench", "serve", "-w", "many-clients")


def test_sim_subcommands_resolve_their_own_keys_not_the_groups():
    # `kvpool sim plan` with a key only `kvpool sim` has is refused by plan's own schema
    assert "unknown key 'colocated'" in fails("sim", "plan", "--set", "colocated=4")
    assert dry("sim", "study", "--trace", T)["prefill"] == 16  # study's own default, not the group's 0
