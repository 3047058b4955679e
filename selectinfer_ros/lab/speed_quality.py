"""The speed-at-quality table: at each agreement with the dense model, our fastest measured
point and llama.cpp's fastest that reach it (rows of ``selectinfer frontier`` or of ``selectinfer
bench`` with the frontier's agreement attached)."""
from __future__ import annotations

AGREEMENTS = (0.95, 0.97, 0.98, 0.99)  # the table's thresholds


def fastest_at(rows: list[dict], min_agreement: float, source: str | None = None) -> dict | None:
    """The fastest decoding row (of ``source`` when given) whose agreement is at least
    ``min_agreement``; ties go to the fewer bytes."""
    fit = [r for r in rows if r["agreement"] >= min_agreement
           and (source is None or r["source"] == source)]
    return max(fit, key=lambda r: (r["decode_tokens_per_second"], -r["weight_bytes"]), default=None)


def speed_at_quality(rows: list[dict], thresholds=AGREEMENTS) -> list[dict]:
    """Per agreement threshold: our fastest row and llama.cpp's that reach it, and the ratio of
    their decode speeds (None where either side has no such row)."""
    out = []
    for a in thresholds:
        ours, llama = fastest_at(rows, a, "selectinfer"), fastest_at(rows, a, "llama.cpp")
        ratio = (ours["decode_tokens_per_second"] / llama["decode_tokens_per_second"]
                 if ours and llama and llama["decode_tokens_per_second"] else None)
        out.append({"min_agreement": a,
                    "ours": ours and ours["name"],
                    "ours_agreement": ours and ours["agreement"],
                    "ours_tokens_per_second": ours and ours["decode_tokens_per_second"],
                    "llama_cpp": llama and llama["name"],
                    "llama_cpp_agreement": llama and llama["agreement"],
                    "llama_cpp_tokens_per_second": llama and llama["decode_tokens_per_second"],
                    "ratio": ratio})
    return out


def print_speed_at_quality(rows: list[dict]) -> None:
    """The speed-at-quality table: at each agreement, our fastest point against llama.cpp's."""
    if not any(r["source"] == "llama.cpp" for r in rows):
        return
    print("fastest at an agreement (decode tok/s; ratio = ours / llama.cpp's):")
    for q in speed_at_quality(rows):
        ours = (f"{q['ours']} ({q['ours_agreement']:.4f}, {q['ours_tokens_per_second']:.1f})"
                if q["ours"] else "-")
        llama = (f"{q['llama_cpp']} ({q['llama_cpp_agreement']:.4f}, "
                 f"{q['llama_cpp_tokens_per_second']:.1f})" if q["llama_cpp"] else "-")
        ratio = f"{q['ratio']:.2f}x" if q["ratio"] is not None else "-"
        print(f"  >= {q['min_agreement']:.2f}: ours {ours}; llama.cpp {llama}; {ratio}")
