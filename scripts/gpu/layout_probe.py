#!/usr/bin/env python3
"""Greedy continuations with top-5 log-probs from a running corridor server, to compare layouts.

    layout_probe.py URL MODEL OUT.json

Sends four fixed prompts (token ids of the Llama-3 tokenizer, so no tokenizer is needed here) to
/v1/completions with temperature 0, 24 new tokens and logprobs=5, and writes what came back.
"""
import json
import sys
import urllib.request

PROMPTS = [
    [128000, 791, 6864, 315, 9822, 374, 12366, 11, 323, 279, 6864, 315, 10057, 374, 20437, 13],
    [128000, 40, 1097, 264, 3838, 315, 1101, 9191, 13],
    [128000] + list(range(1000, 1400, 7)),
    [128000] + [791, 4062, 14198, 39935, 35308, 927, 279, 16053, 5679, 13] * 20,
]


def main():
    url, model, out = sys.argv[1], sys.argv[2], sys.argv[3]
    results = []
    for ids in PROMPTS:
        body = {"model": model, "prompt": ids, "max_tokens": 24, "temperature": 0, "logprobs": 5}
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            lp = json.load(r)["choices"][0]["logprobs"]
        results.append({"prompt_len": len(ids), "tokens": lp["tokens"], "top": lp["top_logprobs"]})
    json.dump(results, open(out, "w"))
    print(f"{out}: {len(results)} prompts, {sum(len(r['tokens']) for r in results)} tokens")


if __name__ == "__main__":
    main()
