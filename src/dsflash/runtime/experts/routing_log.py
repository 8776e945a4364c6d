"""RoutingLog: appends the expert routing of every MoE call to a JSON-lines file (`dsflash serve --record-routing`),
for `dsflash simulate --trace`. Rank 0 only: every rank routes identically.

Lines: one header {"header": {layers, experts, top_k}}; per forward pass {"kind": prefill|decode, "pos", "n",
"layers": [[layer, sorted unique expert ids, tokens per expert], ...]}; {"event": "reset"} when the engine starts
a new sequence. Line-buffered: the file is complete up to the last finished pass.
"""

from __future__ import annotations

import json

import torch


class RoutingLog:
    def __init__(self, path: str, layers: list[int], experts: int, top_k: int):
        self._f = open(path, "a", buffering=1)  # noqa: SIM115  (line-buffered; closed by close())
        self._f.write(json.dumps({"header": {"layers": layers, "experts": experts, "top_k": top_k}}) + "\n")
        self._step: dict | None = None

    def begin(self, start_pos: int, n: int) -> None:
        # a pass of one token after position 0 is a decode step; anything else is (part of) a prefill
        kind = "decode" if n == 1 and start_pos > 0 else "prefill"
        self._step = {"kind": kind, "pos": start_pos, "n": n, "layers": []}

    def moe(self, layer: int, ids: torch.Tensor) -> None:
        """ids [tokens, top_k] of one MoE call."""
        if self._step is not None:
            experts, counts = torch.unique(ids, return_counts=True)
            self._step["layers"].append([layer, experts.tolist(), counts.tolist()])

    def end(self) -> None:
        if self._step is not None:
            self._f.write(json.dumps(self._step, separators=(",", ":")) + "\n")
        self._step = None

    def reset(self) -> None:
        self._f.write('{"event":"reset"}\n')

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()
