"""Reading a compiled XLA program: per-device memory, matmul FLOPs and collective bytes.

`jax.jit(f).lower(abstract inputs).compile()` is the program a device runs; this module reads
what it costs from the program itself rather than from a timer:

- memory by kind from `compiled.memory_analysis()`;
- matmul FLOPs (`dot`s, and the `convolution`s TPU programs write many matmuls as) and the
  bytes of every cross-device collective from the HLO text, each counted as often as it runs.
  XLA's own `cost_analysis()` counts the body of a `while` loop once, so the FLOPs of a
  scanned model would come out about L times too small; here every computation is weighted by
  the number of times it is entered (a while loop's body by its trip count: XLA's
  `known_trip_count`, or, before XLA annotates it, the bound of a `counter < N` condition, as
  `lax.scan` writes it, over the body's step of the counter; every other call once; both
  branches of a conditional count, an upper bound).

A collective counts the larger of its result and its operands: an all-gather's whole result, a
reduce-scatter's whole input, so an all-reduce and the reduce-scatter a backend may lower it to
count alike.

The TPU compiler can run one collective as a chain of pieces ("async collective fusion"): a
start fusion, continuation fusions (which may sit in a later while loop's body, e.g. the head's
all-gather overlapped with the layer loop) and a done fusion, each holding an instruction of the
collective's full shape, tagged with the same `channel_id` and `chain_id`. Such a chain is one
collective: it counts once, as often as its least frequently run piece (its start).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

_HEADER = re.compile(r"^(ENTRY\s+)?%(\S+)\s.*\{\s*$")
# `%name = <shape, or a tuple of shapes> op(operands), attributes`
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*(\(.*?\)|\S+)\s+([\w-]+)\(([^)]*)\)(.*)$")
_SHAPE = re.compile(r"\b(pred|[a-z]+\d+)\[([\d,]*)\]")
_CALLEE = re.compile(r"\b(calls|body|condition|to_apply|true_computation|false_computation)="
                     r"%([\w.-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")
_CHAIN = re.compile(r'\bchain_id="(\d+)"')
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f16": 2, "bf16": 2,
             "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8,
             "c64": 8, "c128": 16}


def _dims(shape: str) -> list[list[int]]:
    return [[int(n) for n in dims.split(",") if n] for _, dims in _SHAPE.findall(shape)]


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string (a tuple's elements summed)."""
    return sum(math.prod(int(n) for n in dims.split(",") if n) * _ITEMSIZE.get(dtype, 4)
               for dtype, dims in _SHAPE.findall(shape))


def _parse(hlo_text: str):
    """{computation: [(name, shape, op, operands, attributes)]}, the entry's name, and the
    result shape of every instruction by name."""
    computations: dict[str, list] = {}
    shapes: dict[str, str] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header and "=" not in line.split("(")[0]:
            current = header.group(2)
            computations[current] = []
            entry = current if header.group(1) else entry
            continue
        instruction = _INSTRUCTION.match(line)
        if instruction and current is not None:
            name, shape, op, operands, attributes = instruction.groups()
            shapes[name] = shape
            computations[current].append((name, shape, op, operands, attributes))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry, shapes


def _tuple_index(instructions: list, name: str) -> int | None:
    """k of `name = get-tuple-element(...), index=k` in `instructions`, else None."""
    for other, _, op, _, attributes in instructions:
        if other == name and op == "get-tuple-element":
            index = re.search(r"\bindex=(\d+)", attributes)
            return int(index.group(1)) if index else None
    return None


def _counter_bound(condition: list) -> tuple[int, int | None] | None:
    """(N, the counter's tuple index) of a loop condition `counter < N` with a constant N (how
    `lax.scan` loops from 0)."""
    constants = {name: operands.strip() for name, _, op, operands, _ in condition
                 if op == "constant"}
    for _, _, op, operands, attributes in condition:
        names = [o.strip().lstrip("%") for o in operands.split(",")]
        if op == "compare" and "direction=LT" in attributes and len(names) == 2:
            bound = constants.get(names[1], "")
            if bound.isdigit():
                return int(bound), _tuple_index(condition, names[0])
    return None


def _counter_step(body: list, index: int | None) -> int:
    """The constant the loop body adds to the counter at tuple index `index` (1 if not found):
    the TPU compiler's bidirectional windowed-einsum loops count in steps of 2."""
    if index is None or not body or body[-1][2] != "tuple":
        return 1
    by_name = {name: (op, operands) for name, _, op, operands, _ in body}
    results = [o.strip().lstrip("%") for o in body[-1][3].split(",")]
    op, operands = by_name.get(results[index], ("", "")) if index < len(results) else ("", "")
    names = [o.strip().lstrip("%") for o in operands.split(",")]
    if op != "add" or len(names) != 2:
        return 1
    for counter, step in (names, names[::-1]):
        kind, value = by_name.get(step, ("", ""))
        if _tuple_index(body, counter) == index and kind == "constant" and value.isdigit():
            return max(int(value), 1)
    return 1


def _trip_count(attributes: str, computations: dict) -> int | None:
    count = _TRIP_COUNT.search(attributes)
    if count:
        return int(count.group(1))
    condition = re.search(r"condition=%([\w.-]+)", attributes)
    bound = _counter_bound(computations.get(condition.group(1), [])) if condition else None
    if bound is None:
        return None
    body = re.search(r"body=%([\w.-]+)", attributes)
    step = _counter_step(computations.get(body.group(1), []), bound[1]) if body else 1
    return -(-bound[0] // step)


def _multiplicities(computations: dict, entry: str) -> tuple[dict[str, int], bool]:
    """How many times each computation runs per execution of the entry, and whether every
    while loop on the way had a known trip count."""
    callers: dict[str, list[tuple[str, int]]] = defaultdict(list)
    known = True
    for caller, instructions in computations.items():
        for _, _, op, _, attributes in instructions:
            trip = 1
            if op == "while":
                count = _trip_count(attributes, computations)
                known &= count is not None
                trip = count or 1
            for kind, callee in _CALLEE.findall(attributes):
                callers[callee].append((caller, trip if kind in ("body", "condition") else 1))
            for group in _BRANCHES.findall(attributes):
                for callee in re.findall(r"%([\w.-]+)", group):
                    callers[callee].append((caller, 1))
    memo: dict[str, int] = {entry: 1}

    def runs(name: str) -> int:
        if name not in memo:
            memo[name] = 0  # a cycle cannot happen in HLO; this only guards the recursion
            memo[name] = sum(runs(caller) * factor for caller, factor in callers[name])
        return memo[name]

    return {name: runs(name) for name in computations}, known


def _convolution_flops(shape: str, lhs: str, kernel: str, attributes: str) -> float:
    """2 x output elements x the input elements each one multiplies: the kernel's input features
    (per group) times, along each window axis, the taps that land on input (at most the window,
    the input's extent, and window / lhs_dilate: the TPU compiler writes a batched matmul as a
    convolution whose batch axes are windows over a dilated input, one real tap each)."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->\w+", attributes)
    lhs_dims, kernel_dims, out = _dims(lhs), _dims(kernel), _dims(shape)
    if not labels or not lhs_dims or not kernel_dims or not out:
        return 0.0
    lhs_labels, kernel_labels = labels.groups()
    if len(lhs_labels) != len(lhs_dims[0]) or len(kernel_labels) != len(kernel_dims[0]):
        return 0.0
    spatial = {label: n for label, n in zip(lhs_labels, lhs_dims[0], strict=True)
               if label.isdigit()}
    dilation = re.search(r"lhs_dilate=([\dx]+)", attributes)
    dilate = [int(d) for d in dilation.group(1).split("x")] if dilation else []
    reads = 1
    for label, n in zip(kernel_labels, kernel_dims[0], strict=True):
        if label == "i":
            reads *= n
        elif label.isdigit():
            step = dilate[int(label)] if int(label) < len(dilate) else 1
            reads *= max(1, min(n, -(-n // step), spatial.get(label, n)))
    return 2.0 * math.prod(out[0]) * reads


def _count(collectives: dict, largest: dict, kind: str, shape: str, moved: int,
           times: int) -> None:
    collectives[kind] += times * moved
    entry = largest[kind, re.sub(r"\{[^{}]*\}", "", shape)]
    entry[0] += times
    entry[1] += times * moved


def analyse_hlo(hlo_text: str) -> dict:
    """Matmul FLOPs and collective bytes (by kind) per device of one execution of the program,
    every loop body counted by its trip count; `loops_known`: whether all trip counts were;
    `largest_collectives`: the eight (kind, result shape) groups that move the most bytes."""
    computations, entry, shapes = _parse(hlo_text)
    runs, known = _multiplicities(computations, entry)
    collectives = dict.fromkeys(COLLECTIVES, 0)
    largest: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    flops = 0.0
    # (channel, chain) -> [kind, result shape, bytes moved, runs of its least run piece]
    chains: dict[tuple[str, str], list] = {}
    for computation, instructions in computations.items():
        times = runs[computation]
        for _, shape, op, operands, attributes in instructions:
            names = [o.strip().lstrip("%") for o in operands.split(",") if o.strip()]
            kind = op.removesuffix("-start")
            if kind in collectives:
                inputs = sum(shape_bytes(shapes.get(n, "")) for n in names)
                moved = max(shape_bytes(shape), inputs)
                chain = _CHAIN.search(attributes)
                if chain:  # a piece of one collective: counted once per chain, below
                    channel = _CHANNEL.search(attributes)
                    key = (channel.group(1) if channel else "", chain.group(1))
                    known_piece = chains.setdefault(key, [kind, shape, moved, times])
                    known_piece[2] = max(known_piece[2], moved)
                    known_piece[3] = min(known_piece[3], times)
                    continue
                _count(collectives, largest, kind, shape, moved, times)
            elif op == "dot" and names:
                lhs = _dims(shapes.get(names[0], ""))
                contracting = _CONTRACTING.search(attributes)
                if lhs and contracting:
                    k = math.prod(lhs[0][int(i)] for i in contracting.group(1).split(",") if i)
                    flops += times * 2.0 * math.prod(_dims(shape)[0]) * k
            elif op == "convolution" and len(names) == 2:
                flops += times * _convolution_flops(shape, shapes.get(names[0], ""),
                                                    shapes.get(names[1], ""), attributes)
    for kind, shape, moved, times in chains.values():
        _count(collectives, largest, kind, shape, moved, times)
    top = sorted(((b, kind, shape, n) for (kind, shape), (n, b) in largest.items()), reverse=True)
    return {"matmul_flops": flops, "collectives": collectives, "loops_known": known,
            "largest_collectives": [{"kind": kind, "shape": shape, "times": n, "bytes": b}
                                    for b, kind, shape, n in top[:8]]}


def read_compiled(compiled) -> dict:
    """Per-device memory by kind (bytes), its peak (arguments + outputs + temporaries - aliased),
    XLA's FLOP count (`xla_flops`, loop bodies once; 0 where the backend has no cost analysis,
    as XLA:GPU compiling without a device) and `analyse_hlo`'s figures."""
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}  # None: XLA:GPU compiled
    kinds = {"arguments": memory.argument_size_in_bytes, "outputs": memory.output_size_in_bytes,
             "temporaries": memory.temp_size_in_bytes, "aliased": memory.alias_size_in_bytes,
             "code": memory.generated_code_size_in_bytes}
    kinds = {k: int(v) for k, v in kinds.items()}
    peak = kinds["arguments"] + kinds["outputs"] + kinds["temporaries"] - kinds["aliased"]
    return {"memory": kinds, "peak_bytes": peak, "xla_flops": float(cost.get("flops", 0.0)),
            **analyse_hlo(compiled.as_text())}
