"""How many times a compiled XLA program reads and writes an array of the head's size.

Memory-bound head operations cost about their number of passes over the head, and the compiled
program says how many it makes: ``head_traffic(compiled.as_text(), num_elements)`` walks the
optimized HLO (``jax.jit(f).lower(...).compile().as_text()``) and adds, for every instruction
that runs, the elements it reads from and writes to head-sized arrays (at least half the
head's number of elements: a copy of the valid rows of a padded head counts), divided by that
number. A fusion or dot reading the head is one read; a slice, gather or dynamic slice of it
(also inside a fusion) counts the elements it takes, so taking two rows costs two rows; a
dynamic-update-slice into it counts the update as a write. Loop bodies count once per
iteration (XLA's known trip count, or for the TPU compiler's counted loops, which do not record
it, the count read from the loop's condition and initial counter); each branch of a conditional
is counted apart, as it runs only when taken. Free instructions (parameters, tuples, bitcasts,
optimization barriers) count nothing.

    python benchmarks/hlo_passes.py   # prints the counts of a few toy programs

Used by ``bench_rownorm.py`` (the head operations' counts, printed beside their timings) and by
the tests that keep the masked formulation at its minimum number of passes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(
        r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\(.*?\)|\S+?(?:\{[^}]*\})?)\s+([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"[a-z]+\d*\[([\d,]*)\]")
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "iota",
         "opt-barrier", "optimization-barrier", "after-all", "partition-id", "replica-id"}
_SLICES = {"slice", "dynamic-slice", "gather"}


@dataclasses.dataclass
class Traffic:
    """Reads and writes in units of the head's size, and the instructions that made them."""

    reads: float = 0.0
    writes: float = 0.0
    ops: list = dataclasses.field(default_factory=list)  # (name, opcode, reads, writes)
    branches: list = dataclasses.field(default_factory=list)  # Traffic of each branch

    def add(self, name: str, op: str, reads: float, writes: float) -> None:
        if reads or writes:
            self.reads += reads
            self.writes += writes
            self.ops.append((name, op, round(reads, 3), round(writes, 3)))


@dataclasses.dataclass
class _Instr:
    name: str
    elements: list[int]  # per result (several for a tuple)
    op: str
    operands: list[str]
    attrs: str
    args: str = ""  # the text between the parentheses (a constant's value)


def computations(text: str) -> tuple[dict[str, list[str]], str]:
    """``({computation name: its instruction lines}, entry computation's name)`` of HLO text."""
    comps: dict[str, list[str]] = {}
    entry, name = "", None
    for line in text.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            name = head.group(2)
            comps[name] = []
            entry = name if head.group(1) else entry
        elif line.startswith("}"):
            name = None
        elif name is not None:
            comps[name].append(line)
    return comps, entry


def _parse(text: str) -> tuple[dict[str, list[_Instr]], str]:
    bodies, entry = computations(text)
    comps: dict[str, list[_Instr]] = {}
    for name, lines in bodies.items():
        comps[name] = []
        for line in lines:
            match = _INSTRUCTION.match(line)
            if match:
                iname, shape, op, rest = match.groups()
                args, _, attrs = rest.partition("),")
                elements = [math.prod(int(v) for v in dims.split(",") if v)
                            for dims in _SHAPE.findall(shape)]
                comps[name].append(_Instr(iname, elements, op,
                                          re.findall(r"%([\w.\-]+)", args),
                                          attrs if attrs else rest, args))
    return comps, entry


def _called(attrs: str, key: str) -> list[str]:
    found = re.search(key + r"=\{([^}]*)\}", attrs) or re.search(key + r"=%([\w.\-]+)", attrs)
    return [c.strip().lstrip("%") for c in found.group(1).split(",")] if found else []


def _fusion_traffic(comp: list[_Instr], size: int, elements: dict) -> tuple[dict, float | None]:
    """Per parameter index: elements a fusion reads of it (None: all of it); and the elements
    its root writes when that is an in-place dynamic-update-slice (None otherwise)."""
    params = {}
    for instr in comp:
        if instr.op == "parameter":
            index = re.match(r"\s*(\d+)", instr.args) or re.match(r"(\d+)", instr.attrs)
            params[instr.name] = int(index.group(1)) if index else len(params)
    partial: dict[int, float | None] = {}
    for pname, index in params.items():
        users = [i for i in comp if pname in i.operands]
        taken = 0.0
        for user in users:
            if user.op in _SLICES and user.operands[0] == pname:
                taken += sum(user.elements)
            elif user.op == "dynamic-update-slice" and user.operands[0] == pname:
                continue
            else:
                taken = None  # type: ignore[assignment]
                break
        partial[index] = taken
    root = comp[-1] if comp else None
    write = None
    if root is not None and root.op == "dynamic-update-slice":
        update = next((i for i in comp if i.name == root.operands[1]), None)
        write = float(sum(update.elements)) if update else None
    return partial, write


def _int_constant(instr: _Instr | None, by_name: dict) -> int | None:
    """The value of an integer scalar constant (through copies), else None."""
    while instr is not None and instr.op == "copy" and instr.operands:
        instr = by_name.get(instr.operands[0])
    if instr is None or instr.op != "constant":
        return None
    return int(instr.args) if re.fullmatch(r"-?\d+", instr.args.strip()) else None


def _trip_count(loop: _Instr, comps: dict, by_name: dict) -> int | None:
    """A while loop's number of iterations: XLA's ``known_trip_count`` when the backend records
    it (XLA:CPU), else read from a counted loop's shape, as the TPU compiler leaves it: the
    condition is ``counter < N`` with ``N`` a constant and the counter a tuple element whose
    initial value is a constant (the body adds one to it, as every `lax.fori_loop` does)."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.attrs)
    if known:
        return int(known.group(1))
    (cond,) = _called(loop.attrs, "condition") or [""]
    body = comps.get(cond, [])
    root = body[-1] if body else None
    if root is not None and root.op == "fusion":  # XLA:CPU wraps the compare in a fusion
        (callee,) = _called(root.attrs, "calls") or [""]
        inner = comps.get(callee, [])
        params = {i.name: re.match(r"(\d+)", i.args) for i in inner if i.op == "parameter"}
        if inner and inner[-1].op == "compare" and len(inner[-1].operands) == 2 and all(
                params.get(o) for o in inner[-1].operands):
            order = [int(params[o].group(1)) for o in inner[-1].operands]  # type: ignore[union-attr]
            root = dataclasses.replace(inner[-1], operands=[root.operands[k] for k in order])
    if root is None or root.op != "compare" or "direction=LT" not in root.attrs \
            or len(root.operands) != 2:
        return None
    counter = by_name.get(root.operands[0])
    limit = _int_constant(by_name.get(root.operands[1]), by_name)
    index = re.match(r"\s*index=(\d+)", counter.attrs) if counter else None
    init = by_name.get(loop.operands[0]) if loop.operands else None
    if counter is None or counter.op != "get-tuple-element" or index is None or limit is None \
            or init is None or init.op != "tuple" or int(index.group(1)) >= len(init.operands):
        return None
    start = _int_constant(by_name.get(init.operands[int(index.group(1))]), by_name)
    return None if start is None else max(limit - start, 0)


def head_traffic(compiled_text: str, num_elements: int) -> Traffic:
    """Passes over arrays of ``num_elements`` elements in optimized HLO text (module docstring)."""
    comps, entry = _parse(compiled_text)
    elements = {i.name: i.elements for body in comps.values() for i in body}
    by_name = {i.name: i for body in comps.values() for i in body}
    big = lambda n: 2 * n >= num_elements  # noqa: E731

    def visit(name: str, times: float, out: Traffic) -> None:
        for instr in comps.get(name, []):
            if instr.op == "while":
                trip = _trip_count(instr, comps, by_name)
                for body in _called(instr.attrs, "body"):
                    visit(body, times * (1 if trip is None else trip), out)
                continue
            if instr.op == "conditional":
                for branch in _called(instr.attrs, "branch_computations") + _called(
                        instr.attrs, "true_computation") + _called(instr.attrs,
                                                                   "false_computation"):
                    taken = Traffic()
                    visit(branch, times, taken)
                    out.branches.append(taken)
                continue
            if instr.op in ("call", "async-start"):
                for callee in _called(instr.attrs, "to_apply") + _called(instr.attrs, "calls"):
                    visit(callee, times, out)
                continue
            if instr.op in _FREE or instr.op.endswith("-done"):
                continue
            partial: dict = {}
            write = None
            if instr.op == "fusion":
                (callee,) = _called(instr.attrs, "calls") or [""]
                partial, write = _fusion_traffic(comps.get(callee, []), num_elements, elements)
            reads = 0.0
            for index, operand in enumerate(instr.operands):
                size = sum(e for e in elements.get(operand, []) if big(e))
                if not size or operand in instr.operands[:index]:
                    continue
                if instr.op in _SLICES and index == 0:
                    reads += sum(instr.elements)
                elif instr.op == "dynamic-update-slice" and index == 0:
                    continue
                else:
                    taken = partial.get(index)
                    reads += size if taken is None else taken
            if instr.op == "dynamic-update-slice":
                writes = float(sum(elements.get(instr.operands[1], [0])))
            elif write is not None:
                writes = write
            else:
                writes = float(sum(e for e in instr.elements if big(e)))
            out.add(instr.name, instr.op, times * reads / num_elements,
                    times * writes / num_elements)

    traffic = Traffic()
    visit(entry, 1.0, traffic)
    return traffic


def summary(traffic: Traffic) -> str:
    """``"4 reads, 1 write"`` plus the branches that run only when taken."""
    def counts(t: Traffic) -> str:
        return f"{t.reads:.3g} reads, {t.writes:.3g} writes"

    text = counts(traffic)
    costly = [b for b in traffic.branches if b.reads or b.writes]
    if costly:
        text += " (+ when taken: " + "; ".join(counts(b) for b in costly) + ")"
    return text


def main() -> None:
    import jax
    import jax.numpy as jnp

    spec = jax.ShapeDtypeStruct((4096, 256), jnp.float32)
    programs = {
        "x * 0.5 (donated)": jax.jit(lambda x: x * 0.5, donate_argnums=0),
        "x - mean(x)": jax.jit(lambda x: x - jnp.mean(x, axis=0)),
        "x[:2].sum()": jax.jit(lambda x: x[:2].sum()),
    }
    for name, fn in programs.items():
        traffic = head_traffic(fn.lower(spec).compile().as_text(), 4096 * 256)
        print(f"{name:20s} {summary(traffic)}  {json.dumps(traffic.ops)}")


if __name__ == "__main__":
    main()
