"""`kvpool bench codec`: what each KV codec costs in answers, and what it saves in bytes.

For every prompt (`codec_prompts.py`, chat template applied) the reference model computes the KV
of all prompt tokens but the last, as the pool would hold it: cut into chunks of `chunk_tokens`
(the last one partial), each chunk encoded and decoded by the codec. The model then runs the last
prompt token on the decoded KV (the first generated position) and continues greedily for
`--new-tokens` tokens, its own new KV computed exactly, as a decode worker does. Against the
same run on the KV as computed (the baseline, `none`):

- `token_agreement` (the result's value): *re-synchronised* (teacher-forced) agreement. At every
  position both runs are fed the baseline's tokens so far, and we count the positions where the
  codec run's greedy choice equals the baseline's; one early near-tie does not count against
  every later position. Over all prompts and positions.
- `token_agreement_to_first_divergence`: *free-running*: the codec run generates on its own and
  counts only the positions before its first differing token (then 0 for the rest), the strict
  figure; `prompts_identical`: the fraction of prompts whose whole continuation is identical.
- `logit_max_abs_diff` / `logit_mean_abs_diff`: at the first generated position, over the
  vocabulary (max over prompts / mean over prompts).
- `bytes_vs_bf16`: payload bytes per token relative to bfloat16 KV, on full chunks of a long
  document (`bytes_vs_bf16_all_chunks`: over every chunk of the prompts, short tails included).
- `encode_gbps` / `decode_gbps`: KV bytes (in the model's dtype) encoded or decoded per second,
  over the full chunks of that document, alternating with a plain copy of the same bytes
  (`memcpy_gbps`, the cost of the `none` path without its copy saved).

Continuations are `--new-tokens` long whatever they contain (EOS is not special), so every prompt
contributes the same number of positions.
"""

from __future__ import annotations

import os
import statistics
import sys
from typing import Any

import click

from kvpool.tools.bench.report import Report, Result, progress, timed
from kvpool.codec import CODECS

DEFAULT_CODECS = "none,int8,fp8,int8+zstd,fp8+zstd,none+zstd"


def _kv_of(cache: Any):
    """`[L, 2, H, T, D]` of a batch-1 DynamicCache (a new tensor)."""
    import torch

    return torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers])


def _round_trip(codec, layout, kv) -> tuple[Any, int]:
    """kv after encoding and decoding each chunk of `layout.chunk_tokens` tokens; total payload bytes."""
    import torch

    from kvpool.codec import decode, encode

    parts, nbytes = [], 0
    for start in range(0, kv.shape[3], layout.chunk_tokens):
        chunk = kv[:, :, :, start:start + layout.chunk_tokens].contiguous()
        payload = encode(codec, layout, chunk)
        nbytes += len(payload)
        parts.append(decode(codec, layout, payload, chunk.shape[3]))
    return torch.cat(parts, dim=3), nbytes


class _Continuations:
    """Greedy continuations of one prompt from a given prefix KV."""

    def __init__(self, rm, ids: list[int], new_tokens: int):
        self.rm, self.ids, self.new_tokens = rm, ids, new_tokens

    def free_running(self, kv) -> tuple[Any, list[int]]:
        """(logits at the first generated position, the greedy tokens)."""
        import torch

        from engine_adapters.hf import cache_from_layers, forward

        cache = cache_from_layers(list(kv), self.rm.model.config)
        ids, out, first = list(self.ids), [], None
        for _ in range(self.new_tokens):
            logits, cache = forward(self.rm.model, ids, cache)
            if first is None:
                first = logits.float().clone()
            token = int(torch.argmax(logits))
            out.append(token)
            ids.append(token)
        return first, out

    def teacher_forced(self, kv, tokens: list[int]) -> list[int]:
        """Greedy choice at each position when fed the last prompt token then `tokens[:-1]`."""
        import torch

        from engine_adapters.hf import cache_argument, cache_from_layers

        cache = cache_from_layers(list(kv), self.rm.model.config)
        feed = torch.tensor([[self.ids[-1]] + tokens[:-1]])
        with torch.inference_mode():
            out = self.rm.model(input_ids=feed, use_cache=True, **{cache_argument(self.rm.model): cache})
        return out.logits[0].argmax(dim=-1).tolist()


def _prefix_kv(rm, ids: list[int]):
    from engine_adapters.hf import forward

    _, cache = forward(rm.model, ids[:-1], None)
    return _kv_of(cache)


def _throughput(codecs: dict, layout, chunks: list, reps: int) -> dict[str, dict[str, list[float]]]:
    """GB/s of encode and decode per codec over `chunks`, alternating with a plain copy."""
    import torch

    from kvpool.codec import encode

    raw = sum(c.numel() * c.element_size() for c in chunks)
    copies = [torch.empty_like(c) for c in chunks]
    out: dict[str, dict[str, list[float]]] = {}
    for name, codec in codecs.items():
        bufs = [bytearray(codec.max_encoded_nbytes(layout, c.shape[3])) for c in chunks]
        payloads = [encode(codec, layout, c) for c in chunks]
        dsts = [torch.empty_like(c) for c in chunks]

        def enc():
            for c, b in zip(chunks, bufs):
                codec.encode_into(layout, c, b)

        def dec():
            for p, d in zip(payloads, dsts):
                codec.decode_into(layout, p, d)

        def copy():
            for c, d in zip(chunks, copies):
                d.copy_(c)

        samples = {"encode": [], "decode": [], "memcpy": []}
        for rep in range(reps + 1):  # rep 0 warms up
            figures = {what: raw / timed(fn) / 1e9 for what, fn in (("encode", enc), ("memcpy", copy), ("decode", dec))}
            if rep:
                for what, gbps in figures.items():
                    samples[what].append(gbps)
        out[name] = samples
    return out


@click.command()
@click.option("--codecs", default=DEFAULT_CODECS, show_default=True,
              help=f"Comma-separated codecs to measure (known: {', '.join(CODECS)}); 'none' is always measured.")
@click.option("--prompts", "num_prompts", type=int, default=28, show_default=True,
              help="How many of the 28 built-in prompts (at least 1).")
@click.option("--new-tokens", type=int, default=64, show_default=True, help="Greedy tokens per prompt.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True,
              help="Model (and so KV) dtype; workers default to float32.")
@click.option("--chunk-tokens", type=int, default=256, show_default=True, help="Tokens per pool chunk.")
@click.option("--reps", type=int, default=5, show_default=True, help="Throughput repetitions (after 1 warm-up).")
@click.option("--threads", type=int, default=None, help="torch threads (default: torch's own).")
@click.option("--json", "as_json", is_flag=True, help="End with one JSON line.")
def codec(codecs: str, num_prompts: int, new_tokens: int, dtype: str, chunk_tokens: int, reps: int,
          threads: int | None, as_json: bool) -> None:
    """Token agreement, logit error, bytes and GB/s of each KV codec on the reference model."""
    from kvpool.tools.bench.codec_prompts import prompts as all_prompts
    from kvpool.codec import get_codec
    from kvpool.errors import KVPoolError

    names = ["none"] + [n.strip() for n in codecs.split(",") if n.strip() and n.strip() != "none"]
    try:
        chosen = {n: get_codec(n) for n in names}
    except KVPoolError as exc:
        raise click.UsageError(str(exc)) from exc
    texts = all_prompts()
    if not 1 <= num_prompts <= len(texts) or new_tokens < 1 or chunk_tokens < 1 or reps < 1:
        raise click.UsageError(f"--prompts must be in 1..{len(texts)}; --new-tokens, --chunk-tokens, --reps >= 1")
    import torch

    from reference_worker.model import load_reference_model

    if threads:
        torch.set_num_threads(threads)
    load_before = os.getloadavg()
    rm = load_reference_model(dtype=dtype)
    layout = rm.layout(chunk_tokens)
    bf16_per_token = layout.num_layers * 2 * layout.kv_heads * layout.head_dim * 2
    prompts = [rm.encode_chat([{"role": "user", "content": t}]) for t in texts[:num_prompts]]

    per = {n: {"tf": [], "fr": [], "identical": 0, "max": [], "mean": [], "bytes": 0, "krel": [], "vrel": []}
           for n in names}
    tokens_total = 0
    bar, advance = progress(len(prompts) * len(names), f"codec bench ({len(prompts)} prompts x {new_tokens} tokens)")
    with bar:
        for ids in prompts:
            kv = _prefix_kv(rm, ids)
            tokens_total += kv.shape[3]
            runs = _Continuations(rm, ids, new_tokens)
            ref_logits, ref_tokens = runs.free_running(kv)
            ref_tf = runs.teacher_forced(kv, ref_tokens)
            for name, c in chosen.items():
                kv_hat, nbytes = _round_trip(c, layout, kv)
                logits, tokens = runs.free_running(kv_hat)
                tf = runs.teacher_forced(kv_hat, ref_tokens)
                diff = (logits - ref_logits).abs()
                first = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), new_tokens)
                rec = per[name]
                rec["tf"].append(sum(a == b for a, b in zip(tf, ref_tf)) / new_tokens)
                rec["fr"].append(first / new_tokens)
                rec["identical"] += first == new_tokens
                rec["max"].append(float(diff.max()))
                rec["mean"].append(float(diff.mean()))
                rec["bytes"] += nbytes
                for part, key in ((0, "krel"), (1, "vrel")):
                    x = kv[:, part].double()
                    rec[key].append(float((kv_hat[:, part].double() - x).norm() / x.norm()))
                advance()

    # bytes and speed on full chunks of one long document (every prompt's text, one after another)
    doc = rm.encode("\n\n".join(texts))
    full = (len(doc) - 1) // chunk_tokens
    if full < 1:
        raise click.UsageError(f"--chunk-tokens {chunk_tokens} leaves no full chunk in a {len(doc)}-token document")
    print(f"codec bench: encode/decode speed over {full} full chunks of a {len(doc)}-token document", file=sys.stderr)
    doc_kv = _prefix_kv(rm, doc)
    chunks = [doc_kv[:, :, :, i * chunk_tokens:(i + 1) * chunk_tokens].contiguous() for i in range(full)]
    full_bytes = {n: sum(len(_encode(c, layout, ch)) for ch in chunks) for n, c in chosen.items()}
    speed = _throughput(chosen, layout, chunks, reps)
    load_after = os.getloadavg()

    report = Report("codec")
    none_tf = statistics.fmean(per["none"]["tf"])
    for name, c in chosen.items():
        rec, sp = per[name], speed[name]
        tf_all = statistics.fmean(rec["tf"])
        extra = {
            "codec_id": c.codec_id, "lossless": c.lossless,
            "bytes_vs_bf16": round(full_bytes[name] / (full * chunk_tokens * bf16_per_token), 4),
            "bytes_vs_bf16_all_chunks": round(rec["bytes"] / (tokens_total * bf16_per_token), 4),
            "bytes_vs_model_dtype": round(full_bytes[name] / (full * chunk_tokens * layout.bytes_per_token), 4),
            "token_agreement": round(tf_all, 4),
            "token_agreement_method": "teacher-forced (re-synchronised at every position)",
            "token_agreement_to_first_divergence": round(statistics.fmean(rec["fr"]), 4),
            "prompts_identical": round(rec["identical"] / len(prompts), 4),
            "logit_max_abs_diff": round(max(rec["max"]), 5), "logit_mean_abs_diff": round(statistics.fmean(rec["mean"]), 6),
            "kv_rel_rms_error_k": round(statistics.fmean(rec["krel"]), 6),
            "kv_rel_rms_error_v": round(statistics.fmean(rec["vrel"]), 6),
            "encode_gbps": round(statistics.median(sp["encode"]), 3), "decode_gbps": round(statistics.median(sp["decode"]), 3),
            "encode_gbps_spread": [round(min(sp["encode"]), 3), round(max(sp["encode"]), 3)],
            "decode_gbps_spread": [round(min(sp["decode"]), 3), round(max(sp["decode"]), 3)],
            "memcpy_gbps": round(statistics.median(sp["memcpy"]), 3),
            "prompts": len(prompts), "new_tokens": new_tokens, "dtype": dtype, "chunk_tokens": chunk_tokens,
        }
        report.results.append(Result(case=name, value=round(tf_all, 4), unit="fraction", baseline="none",
                                     baseline_value=round(none_tf, 4), ratio=round(tf_all / none_tf, 4) if none_tf else None,
                                     spread=[round(min(rec["tf"]), 4), round(max(rec["tf"]), 4)], extra=extra))
    report.notes.append(f"value: teacher-forced token agreement with the uncompressed run over {len(prompts)} prompts x "
                        f"{new_tokens} greedy tokens (spread: per prompt); the codec is applied to the prompt's KV in "
                        f"{chunk_tokens}-token chunks; goal int8: bytes_vs_bf16 <= 0.5 and agreement >= 0.95")
    report.notes.append(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}; torch threads "
                        f"{torch.get_num_threads()}; GB/s are {dtype} KV bytes per second")
    report.emit(as_json)
    _print_summary(report, as_json)


def _encode(codec, layout, kv):
    from kvpool.codec import encode

    return encode(codec, layout, kv)


def _print_summary(report: Report, as_json: bool) -> None:
    """The figures the table's generic columns do not show, one line per codec."""
    out = sys.stderr if as_json else sys.stdout
    for r in report.results:
        e = r.extra
        print(f"{r.case:>10}: bytes {e['bytes_vs_bf16']:.3f}x bf16, agreement {e['token_agreement']:.3f} "
              f"(to first divergence {e['token_agreement_to_first_divergence']:.3f}, identical "
              f"{e['prompts_identical']:.2f}), logits max {e['logit_max_abs_diff']:.3g} mean "
              f"{e['logit_mean_abs_diff']:.3g}, encode {e['encode_gbps']:.2f} GB/s, decode {e['decode_gbps']:.2f} GB/s",
              file=out)
