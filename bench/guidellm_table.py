#!/usr/bin/env python3
"""One line per concurrency level from a guidellm JSON report (`guidellm run` with a json
output): requests completed and failed, TTFT and inter-token latency (median, p99) and output
tokens per second (guidellm's mean rate, and output tokens over the level's duration).

  python3 bench/guidellm_table.py OUT/guidellm.json
"""
import json
import sys


def main(path):
    j = json.load(open(path))
    print(f"{'streams':>7} {'ok':>5} {'err':>4} {'seconds':>8} {'ttft med':>10} {'ttft p99':>10} {'itl med':>9} {'itl p99':>9} {'out t/s':>9} {'out/dur':>9}")
    for b in j["benchmarks"]:
        m = b["metrics"]
        s = b["config"]["strategy"]
        streams = s.get("streams", s.get("max_concurrency"))
        tot = m["request_totals"]
        ttft = m["time_to_first_token_ms"]["successful"]
        itl = m["inter_token_latency_ms"]["successful"]
        out = m["output_tokens_per_second"]["successful"]["mean"]
        toks = m["output_token_count"]["successful"]["total_sum"]
        print(
            f"{streams:>7} {tot['successful']:>5} {tot['errored']:>4} {b['duration']:>8.1f} {ttft['median']:>8.1f}ms {ttft['percentiles']['p99']:>8.1f}ms "
            f"{itl['median']:>7.2f}ms {itl['percentiles']['p99']:>7.2f}ms {out:>9.1f} {toks / b['duration']:>9.1f}"
        )


if __name__ == "__main__":
    main(sys.argv[1])
