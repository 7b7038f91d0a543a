"""Reads a compiled executable's optimized HLO (`compiled.as_text()`): what XLA will run, after
its passes, which is where a GPU build's problems show (a `ragged_dot` expanded over every
expert, a weight slice copied before a kernel, a kernel missing) while the lowered text still
looks right.

Owns the parse (computations, instructions, their shapes, operands and called computations)
and its readings: the Triton kernels a step launches (`triton_kernels`), the tensors an
MoE layer holds that carry both the expert and the token dimension (`expert_by_token`), and the
bytes of each entry argument the step reads (`argument_reads`: following the value through
bitcasts, tuples, while loops and fusions to the ops that read it; a slice, gather or dynamic
slice reads its output's bytes, a kernel indexing a stacked weight one layer of it, a
grouped-matmul kernel the experts that have rows, anything else the whole value, times the trip
count of the loops around it; a slice written to a buffer of its own before another op reads
it is reported as copied), and how many ops XLA rematerialized to fit the device's memory.
Text in, facts out: no jax.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
               "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
               "f64": 8}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) \((.*)\) -> .* \{$")
_INSTR = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = (.*)$")
_COMMENT = re.compile(r"/\*.*?\*/")
_NAME = re.compile(r"%([\w.\-]+)")
# Kernels that read only the experts with rows (pallas_kernels.grouped_matmul)
GROUPED_KERNELS = ("grouped_matmul", "grouped_swiglu")
# Kernels that take a weight stacked [L, ...] with a layer index and read that layer: the rank
# of one layer's weight (a grouped kernel's [E, N, K], a quantized matmul's [N, K])
LAYER_INDEXED = {"grouped_matmul": 3, "grouped_swiglu": 3, "quant_matmul_int8": 2,
                 "quant_matmul_int4": 2, "quant_matmul_fp8": 2}


@dataclasses.dataclass
class Instr:
    name: str
    shape: str  # an array type "bf16[8,2048]" or a tuple "(s32[], f32[4])"
    opcode: str
    operands: list[str]
    attrs: str  # everything after the operands
    args: str = ""  # the text inside the parentheses (a parameter's number)
    root: bool = False  # the computation's result

    def arrays(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(dt, tuple(int(d) for d in dims.split(",") if d))
                for dt, dims in _ARRAY.findall(self.shape) if dt in DTYPE_BYTES]

    @property
    def nbytes(self) -> int:
        return sum(math.prod(dims) * DTYPE_BYTES[dt] for dt, dims in self.arrays())

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=(%[\w.\-]+|\{{[^}}]*\}}|\d+)", self.attrs)
        return None if m is None else m.group(1)

    @property
    def called(self) -> list[str]:
        """The computations this instruction calls (fusion, while body, branches, ...)."""
        names = []
        for key in ("calls", "body", "to_apply", "branch_computations"):
            value = self.attr(key)
            if value:
                names += _NAME.findall(value)
        return names

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return "" if m is None else m.group(1)

    @property
    def kernel(self) -> str | None:
        """The Triton kernel a custom call launches (its Pallas name), or None."""
        if self.opcode != "custom-call" or "__gpu$xla.gpu.triton" not in self.attrs:
            return None
        m = re.search(r'name = "([^"]*)"', self.attrs)
        return m.group(1) if m else "triton"

    @property
    def trip_count(self) -> int:
        m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', self.attrs)
        return int(m.group(1)) if m else 1


@dataclasses.dataclass
class Module:
    computations: dict[str, list[Instr]]
    entry: str
    entry_params: list[tuple[str, str]]  # (argument name, shape) in order

    def instr(self, computation: str, name: str) -> Instr | None:
        return next((i for i in self.computations[computation] if i.name == name), None)


def _split_shape(rest: str) -> tuple[str, str]:
    """(shape, remainder) of `rest`, whose shape may be a parenthesized tuple."""
    if not rest.startswith("("):
        shape, _, tail = rest.partition(" ")
        return shape, tail
    depth = 0
    for i, c in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth == 0:
            return rest[:i + 1], rest[i + 2:]
    return rest, ""


def _balanced(text: str, start: int) -> int:
    """The index just past the parenthesis that closes the one at `start`."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    return len(text)


def parse(text: str) -> Module:
    computations: dict[str, list[Instr]] = {}
    entry, entry_params, current = "", [], None
    for raw in text.splitlines():
        line = _COMMENT.sub("", raw)
        header = _HEADER.match(line)
        if header:
            current = header.group(2)
            computations[current] = []
            if header.group(1):
                entry = current
                entry_params = [(p.split(":")[0].strip(), p.split(":", 1)[1].strip())
                                for p in _split_params(header.group(3))]
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line)
        if m is None or current is None:
            continue
        shape, rest = _split_shape(m.group(3))
        paren = rest.find("(")
        if paren < 0:
            continue
        end = _balanced(rest, paren)
        computations[current].append(Instr(
            name=m.group(2), shape=shape, opcode=rest[:paren].strip(),
            operands=_NAME.findall(rest[paren:end]), attrs=rest[end:],
            args=rest[paren + 1:end - 1], root=bool(m.group(1))))
    return Module(computations, entry, entry_params)


def _split_params(text: str) -> list[str]:
    out, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += {"(": 1, ")": -1, "[": 1, "]": -1, "{": 1, "}": -1}.get(c, 0)
        if c == "," and depth == 0:
            out.append(text[start:i])
            start = i + 1
    if text[start:].strip():
        out.append(text[start:])
    return out


def triton_kernels(module: Module) -> dict[str, int]:
    """Kernel name -> launches in the program text (a kernel inside a loop body counts once)."""
    counts: dict[str, int] = defaultdict(int)
    for instrs in module.computations.values():
        for i in instrs:
            if i.kernel:
                counts[i.kernel] += 1
    return dict(counts)


def rematerialized(module: Module) -> int:
    """Instructions XLA recomputes to lower peak memory (its rematerialization pass names the
    copies `*.remat*`): a step that fits only by reading some weights more than once."""
    return sum(".remat" in i.name for instrs in module.computations.values() for i in instrs)


_PLUMBING = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant"}


def expert_by_token(module: Module, num_experts: int, token_counts: set[int],
                    exclude: set[tuple[int, ...]] = frozenset(),
                    scope: str = "routed_experts") -> list[str]:
    """Tensors an MoE layer's routed experts compute (ops under the name scope `scope`,
    `layers.ROUTED_SCOPE`) with the expert dimension beside a token dimension (a count in
    `token_counts`) and a feature dimension: the dense expansion over every expert (the router,
    outside the scope, holds [N, E] logits by design). `exclude`: shapes that are weights (an
    expert stack), not activations."""
    found = []
    counts = {t for t in token_counts if t > 1}
    for instrs in module.computations.values():
        for i in instrs:
            # (a bitcast counts: it may be the only view with the expert dimension apart)
            if i.opcode in _PLUMBING - {"bitcast"} or f"/{scope}/" not in f"/{i.op_name}/":
                continue
            for dt, dims in i.arrays():
                big = [d for d in dims if d > 1]
                if dims in exclude or len(big) < 3 or num_experts not in dims:
                    continue
                rest = list(dims)
                rest.remove(num_experts)
                if counts & set(rest):
                    found.append(f"{dt}[{','.join(map(str, dims))}] {i.opcode} ({i.name})")
    return found


@dataclasses.dataclass(frozen=True)
class Read:
    bytes: float  # bytes read per run of the executable
    how: tuple[str, ...]  # the ops that read it (opcode or kernel name)
    copied: float = 0.0  # of those, bytes a slice wrote to a buffer of its own (then re-read)


def argument_reads(module: Module, active_experts: float = 1.0) -> dict[str, Read]:
    """Entry argument name -> the bytes the executable reads of it. `active_experts`: the share
    of experts a grouped-matmul kernel reads (the experts with rows: at most N * k of E)."""
    users: dict[str, dict[str, list[Instr]]] = {}
    for comp, instrs in module.computations.items():
        by = defaultdict(list)
        for i in instrs:
            for op in set(i.operands):
                by[op].append(i)
        users[comp] = by
    params = {comp: {int(i.args): i for i in instrs if i.opcode == "parameter"}
              for comp, instrs in module.computations.items()}
    fused = {i.called[0] for instrs in module.computations.values() for i in instrs
             if i.opcode == "fusion" and i.called}

    def materialized(comp: str, value: Instr) -> bool:
        """Whether a slice's result is a buffer of its own: outside a fusion, or what its
        fusion computes (its root, or a bitcast or element of its root)."""
        if comp not in fused or value.root:
            return True
        later = users[comp].get(value.name, [])
        return bool(later) and all(u.root and u.opcode in ("bitcast", "tuple") for u in later)

    copies: list[float] = []

    def reads(comp: str, value: Instr, nbytes: int, mult: float, element: int | None,
              how: list[str], depth: int = 0) -> float:
        if depth > 64:
            return nbytes * mult
        total = 0.0
        for u in users[comp].get(value.name, []):
            positions = [p for p, op in enumerate(u.operands) if op == value.name]
            if u.opcode in ("bitcast", "copy-start", "copy-done") or (
                    u.opcode == "get-tuple-element" and element is not None
                    and u.attr("index") == str(element)):
                total += reads(comp, u, nbytes, mult, None, how, depth + 1)
            elif u.opcode == "get-tuple-element":
                continue
            elif u.opcode == "tuple":
                for p in positions:
                    for t in users[comp].get(u.name, []):
                        if t.opcode == "while":
                            body = t.attr("body")[1:]
                            total += reads(body, params[body][0], nbytes, mult * t.trip_count,
                                           p, how, depth + 1)
            elif u.opcode == "conditional":  # operand p + 1 is branch p's parameter
                for p in positions:
                    if 1 <= p <= len(u.called):
                        callee = u.called[p - 1]
                        total += reads(callee, params[callee][0], nbytes, mult, element, how,
                                       depth + 1)
            elif u.opcode in ("fusion", "call") and u.called:
                callee = u.called[0]
                for p in positions:
                    if p in params[callee]:
                        total += reads(callee, params[callee][p], nbytes, mult, element, how,
                                       depth + 1)
            elif u.opcode in ("dynamic-slice", "slice", "gather"):
                if materialized(comp, u):
                    how.append(f"{u.opcode} (copied)")
                    copies.append(u.nbytes * mult)
                else:
                    how.append(u.opcode)
                total += u.nbytes * mult
            elif u.kernel in LAYER_INDEXED:
                how.append(u.kernel)
                arrays = value.arrays()
                dims = arrays[0][1] if arrays else ()
                # a stack the kernel indexes: one layer a call
                layers = dims[0] if len(dims) == LAYER_INDEXED[u.kernel] + 1 else 1
                share = active_experts if u.kernel in GROUPED_KERNELS else 1.0
                total += nbytes / layers * share * mult
            elif u.opcode == "while":  # a loop's state passes to its body through a tuple
                continue
            else:
                how.append(u.kernel or u.opcode)
                total += nbytes * mult
        return total

    out = {}
    entry = module.entry
    for index, (name, _) in enumerate(module.entry_params):
        p = params[entry].get(index)
        if p is None:
            continue
        how: list[str] = []
        copies.clear()
        total = reads(entry, p, p.nbytes, 1.0, None, how)
        out[name] = Read(total, tuple(sorted(set(how))), sum(copies))
    return out
