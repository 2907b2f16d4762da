"""HBM bytes of one call of a compiled TPU program, read from its optimised HLO text.

libtpu's ``cost_analysis()["bytes accessed"]`` sums every instruction's operand and result bytes
whatever memory they live in, and counts a ``while`` body once. On a TPU the compiler stages some
weights through the on-chip VMEM (memory space ``S(1)`` in the HLO layouts): a ``copy-start`` /
``copy-done`` pair reads the weight from HBM once and the matmul then reads the VMEM copy. The cost
analysis counts such a weight four times (the HBM read, the VMEM write as the ``copy-start``
tuple's result, the ``copy-done`` result, the matmul's VMEM read); HBM sees it once.

This module counts, per instruction outside fused computations, the bytes of its operands and
results in memory space 0 (HBM), the way XLA's ``HloCostAnalysis`` bounds a fusion's reads (a fused
parameter consumed only by slices counts the slices; the buffer a ``dynamic-update-slice`` or
``scatter`` writes in place counts only the update), and multiplies a ``while`` body by its trip
count when the loop's condition compares the induction variable with a constant (the layer scan);
a loop with a runtime bound (attention's loop over key blocks) counts once. ``copy-start``'s
second tuple element aliases its source and is not traffic. Bytes are logical (no tile padding).

    python -m benchmarks.hlo_bytes program.hlo      # the table by memory space and category
"""

from __future__ import annotations

import argparse
import collections
import math
import re
import sys
from typing import Any

ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4}
ITEMSIZE |= {"f64": 8, "s64": 8, "u64": 8}
SPACES = {0: "HBM", 1: "VMEM"}
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\](\{[^}]*\})?")
_INSTR = re.compile(r"^\s*(ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9-]*)\((.*)$")
_FREE = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "while", "conditional", "call"}
_FREE |= {"partition-id", "replica-id", "after-all", "copy-done", "slice-done", "opt-barrier", "iota"}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_SLICING = ("dynamic-slice", "slice", "gather")
_BRANCHES = r"(?:branch_computations=\{|true_computation=%|false_computation=%)([^}]*)"
_IN_PLACE = ("dynamic-update-slice", "scatter")


def arrays(type_text: str) -> list[tuple[int, int, str]]:
    """``(bytes, memory space, "dtype[dims]")`` of each array in an HLO type (a tuple gives several)."""
    out = []
    for m in _ARRAY.finditer(type_text):
        dtype, dims, layout = m.groups()
        if dtype not in ITEMSIZE:
            continue
        n = math.prod(int(d) for d in dims.split(",")) if dims else 1
        space = re.search(r"S\((\d+)\)", layout or "")
        out.append((n * ITEMSIZE[dtype], int(space.group(1)) if space else 0, f"{dtype}[{dims}]"))
    return out


def parse(hlo: str) -> tuple[dict[str, list[dict[str, Any]]], str]:
    """Computations of an HLO module text: name -> instructions (name, type, op, operands, attrs,
    root, metadata op_name), and the entry computation's name."""
    comps: dict[str, list[dict[str, Any]]] = {}
    cur, entry = None, ""
    for ln in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%(\S+) .*\{\s*$", ln)
        if head:
            cur = head.group(2)
            comps[cur] = []
            entry = cur if head.group(1) else entry
            continue
        if ln.startswith("}"):
            cur = None
            continue
        m = _INSTR.match(ln)
        if not (m and cur):
            continue
        root, name, typ, op, rest = m.groups()
        depth, i = 1, 0
        while depth and i < len(rest):
            depth += (rest[i] == "(") - (rest[i] == ")")
            i += 1
        meta = re.search(r'op_name="([^"]*)"', rest)
        comps[cur].append(
            {
                "name": name,
                "type": typ,
                "op": op,
                "args": rest[: i - 1],
                "operands": re.findall(r"%([\w.-]+)", rest[: i - 1]),
                "attrs": rest[i:],
                "root": bool(root),
                "meta": meta.group(1) if meta else "",
                "index": int(re.match(r"(\d+)", rest).group(1)) if op == "parameter" else -1,  # type: ignore[union-attr]
            }
        )
    return comps, entry


def _update(x: dict[str, Any]) -> str:
    """The update operand of a ``dynamic-update-slice`` (operand, update, indices...) or a
    ``scatter`` (operand, indices, updates)."""
    return x["operands"][1 if x["op"] == "dynamic-update-slice" else -1]


class Module:
    """A parsed HLO module and the bytes each of its instructions moves."""

    def __init__(self, hlo: str):
        self.comps, self.entry = parse(hlo)
        self.by_name = {(c, x["name"]): x for c, xs in self.comps.items() for x in xs}
        self.fused = set()
        for xs in self.comps.values():
            for x in xs:
                self.fused.update(re.findall(r"(?:calls|to_apply)=%([\w.-]+)", x["attrs"]))
        self.multiplier = self._multipliers()

    def _trip_count(self, cond: str) -> int:
        """The constant bound of a ``while`` condition ``i < N`` (1 when not a constant)."""
        xs = {x["name"]: x for x in self.comps.get(cond, [])}
        root = next((x for x in xs.values() if x["root"]), None)
        if root and root["op"] == "compare" and "direction=LT" in root["attrs"]:
            bound = xs.get(root["operands"][1])
            if bound and bound["op"] == "constant":
                m = re.fullmatch(r"\s*(\d+)\s*", bound["args"])
                if m:
                    return int(m.group(1))
        return 1

    def _multipliers(self) -> dict[str, int]:
        mult = {self.entry: 1}
        todo = [self.entry]
        while todo:
            c = todo.pop()
            for x in self.comps[c]:
                if x["op"] == "while":
                    body = re.search(r"body=%([\w.-]+)", x["attrs"])
                    cond = re.search(r"condition=%([\w.-]+)", x["attrs"])
                    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', x["attrs"])
                    if body and cond:
                        n = int(known.group(1)) if known else self._trip_count(cond.group(1))
                        mult[body.group(1)] = mult[c] * n
                        todo.append(body.group(1))
                for callee in re.findall(_BRANCHES, x["attrs"]):
                    for name in re.findall(r"%?([\w.-]+)", callee):
                        if name in self.comps and name not in mult:
                            mult[name] = mult[c]
                            todo.append(name)
        return mult

    def _param_read(self, comp: str, pname: str) -> int | None:
        """Bytes a fused computation reads of its parameter ``pname`` (None: all of it)."""
        users = [y for y in self.comps[comp] if pname in y["operands"]]
        if not users or any(y["root"] and y["name"] == pname for y in self.comps[comp]):
            return None  # the fusion's result is (a view of) the parameter: read whole
        total = 0
        for u in users:
            if u["op"] == "bitcast":
                b = self._param_read(comp, u["name"])
            elif u["op"] in _SLICING and u["operands"][0] == pname:
                b = sum(a[0] for a in arrays(u["type"]))
            elif u["op"] in _IN_PLACE and u["operands"][0] == pname:
                b = 0
            elif u["op"] == "fusion":
                callee = re.search(r"calls=%([\w.-]+)", u["attrs"]).group(1)  # type: ignore[union-attr]
                b = 0
                for i, o in enumerate(u["operands"]):
                    if o == pname:
                        inner = next(y["name"] for y in self.comps[callee] if y["index"] == i)
                        r = self._param_read(callee, inner)
                        if r is None:
                            return None
                        b += r
            else:
                return None
            if b is None:
                return None
            total += b
        return total

    def operand(self, comp: str, name: str) -> list[tuple[int, int, str]]:
        x = self.by_name.get((comp, name))
        return arrays(x["type"]) if x else []

    def instruction(self, comp: str, x: dict[str, Any]) -> tuple[list, list]:
        """``(reads, writes)`` of one instruction: lists of ``(bytes, space, what)`` where ``what``
        is the operand's array type (reads) or ``out`` / ``update`` / ``alias`` (writes)."""
        op, out = x["op"], arrays(x["type"])
        reads: list[tuple[int, int, str]] = []
        writes: list[tuple[int, int, str]] = [(b, s, "out") for b, s, _ in out]
        if op == "fusion":
            callee = re.search(r"calls=%([\w.-]+)", x["attrs"]).group(1)  # type: ignore[union-attr]
            for y in self.comps[callee]:
                if y["index"] < 0:
                    continue
                src = self.operand(comp, x["operands"][y["index"]])
                b = self._param_read(callee, y["name"])
                reads += [(a[0] if b is None else b, a[1], a[2]) for a in src[: 1 if b is not None else None] if b != 0]
            root = next(y for y in self.comps[callee] if y["root"])
            if root["op"] in _IN_PLACE:
                upd = self.by_name.get((callee, _update(root)))
                writes = [(sum(a[0] for a in arrays(upd["type"])) if upd else 0, out[0][1], "update")]
        elif op in _IN_PLACE:
            upd = self.operand(comp, _update(x))
            reads, writes = [(upd[0][0], upd[0][1], upd[0][2])], [(upd[0][0], out[0][1], "update")]
        elif op in ("dynamic-slice", "slice-start", "copy-start"):
            src = self.operand(comp, x["operands"][0])
            size = out[0][0] if op != "copy-start" else src[0][0]
            reads = [(size, src[0][1], src[0][2])]
            writes = [(out[0][0], out[0][1], "out")] + [(b, s, "alias") for b, s, _ in out[1:]]
        else:
            for o in x["operands"]:
                reads += self.operand(comp, o)
        return reads, writes

    def rows(self):
        """Every costed instruction: ``(computation, instruction, multiplier, reads, writes)``."""
        for comp, xs in self.comps.items():
            if comp in self.fused or comp not in self.multiplier:
                continue
            for x in xs:
                if x["op"] in _FREE:
                    continue
                reads, writes = self.instruction(comp, x)
                yield comp, x, self.multiplier[comp], reads, writes


def _elements(shape_text: str) -> int:
    dims = shape_text.strip("[]")
    return math.prod(int(d) for d in dims.split(",")) if dims else 1


def cache_copies(hlo: str, elements: int) -> list[str]:
    """Instructions of the optimised HLO ``hlo`` that copy or transpose an array of ``elements``
    elements (one device's whole K or V cache), in any computation (a fusion counts by its root)."""
    out, roots = [], {}
    comp = None
    for ln in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%(\S+) ", ln)
        if head and ln.rstrip().endswith("{"):
            comp = head.group(1)
        m = re.match(r"\s*ROOT %\S+ = \S+\[[^\]]*\]\S* ([a-z-]+)\(", ln)
        if m and comp:
            roots[comp] = m.group(1)
    for ln in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (\w+)(\[[^\]]*\])\S* ([a-z-]+)\(", ln)
        if not m or _elements(m.group(3)) != elements:
            continue
        op = m.group(4)
        if op == "fusion":
            callee = re.search(r"calls=%([\w.-]+)", ln)
            op = roots.get(callee.group(1), "fusion") if callee else op
        if op in ("copy", "copy-start", "transpose"):
            out.append(ln.strip()[:160])
    return out


def collectives(hlo: str) -> dict[str, int]:
    counts = {c: len(re.findall(rf"\s{c}(?:-start)?\(", hlo)) for c in COLLECTIVES}
    return {k: v for k, v in counts.items() if v}


def hbm_bytes(hlo: str) -> dict[str, Any]:
    """HBM bytes of one call of the program ``hlo`` (see the module doc): ``hbm`` (memory space 0
    reads and writes, ``copy-start`` aliases excluded), ``all_spaces`` (every operand and result,
    what libtpu's cost analysis sums, with loop bodies scaled), and ``staged`` (bytes written into
    VMEM by ``copy-start`` / ``slice-start``: the compiler's prefetches)."""
    m = Module(hlo)
    hbm = every = staged = 0
    for _, x, k, reads, writes in m.rows():
        hbm += k * sum(b for b, s, w in reads + writes if s == 0 and w != "alias")
        every += k * sum(b for b, _, _ in reads + writes)
        if x["op"] in ("copy-start", "slice-start"):
            staged += k * sum(b for b, s, w in writes if s != 0 and w == "out")
    return {"hbm": hbm, "all_spaces": every, "staged": staged}


def breakdown(hlo: str) -> list[tuple[str, str, str, int]]:
    """``(space, R/W, category, bytes)`` rows, largest first; a read's category is the operand's
    array type with the op that reads it (a weight stack's type names the weight)."""
    by: collections.Counter = collections.Counter()
    m = Module(hlo)
    for _, x, k, reads, writes in m.rows():
        for b, s, what in reads:
            by[(SPACES.get(s, f"S{s}"), "R", f"{x['op']} {what}")] += k * b
        for b, s, what in writes:
            by[(SPACES.get(s, f"S{s}"), "W", f"{x['op']} {what}")] += k * b
    return sorted(((*key, v) for key, v in by.items()), key=lambda r: -r[3])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.hlo_bytes",
        description="Bytes of a compiled program by memory space, read/write and operand (MiB, the largest "
        "first), then its HBM total: the text of an optimised HLO module (tpu_compile --hlo-dir writes them).",
    )
    p.add_argument("hlo", help="an optimised HLO text file")
    args = p.parse_args(argv)
    with open(args.hlo) as f:
        text = f.read()
    for space, rw, cat, b in breakdown(text):
        if b >= 1 << 20:
            print(f"{b / 2**20:10.1f} MiB  {space:4} {rw}  {cat}")
    print({k: f"{v / 2**20:.1f} MiB" for k, v in hbm_bytes(text).items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
