"""SASS instructions per element of the compact-moment AdamW CUDA kernel's main loop (no GPU needed).

Compiles csrc/cuda/adamw_cuda.cu of a tree (the working tree, or a git revision with --rev; one translation unit,
which since issue 55 includes the kernels from adamw_lanes.cuh, adamw_dense.cuh and adamw_compact.cuh -- both
layouts are read) to a cubin for one arch with nvcc, disassembles it with cuobjdump, and counts the instructions of
the main loop of the named kernel instances (static count: every instruction between the loop's head and its
backward branch; out-of-line slow paths -- the IEEE divide/sqrt fallbacks that are CALLs -- are not in it, cold
branches inside it are). The main loop is the innermost loop that has the
group-amax shuffles and the widest global loads; where the kernel has two such loops (since issue 43
stop 50: one for grads 16-byte aligned like the other buffers, the case of every grad autograd
allocates, one for a grad view at another offset, which shifts its bytes into place), the main loop
is the aligned one, the smaller, and the other is printed beside it; so is the two-stage loop (since
issue 43 stop 51: the next pass's loads copied into shared memory, LDGSTS, while the current one updates;
AdamConfig::stages 2), where the kernel has one. Per element = loop instructions / elements each thread
updates per iteration (1 in the one-element-per-lane kernel, kVE = 8 after).

    python benchmarks/cuda_sass_count.py --arch sm_90            # working tree
    python benchmarks/cuda_sass_count.py --arch sm_90 --rev HEAD # a revision
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (label, PDT, GDT, SDT, MODE): bf16 params + bf16 grads, 8-bit master corrections
INSTANCES = [("8bit+8bit", 2, 2, 8, 3), ("8bit+4bit_m", 2, 2, 9, 3)]


def tool(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    for d in [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin")]:
        if os.path.isfile(os.path.join(d, name)):
            return os.path.join(d, name)
    import triton  # ships cuobjdump / nvdisasm

    hits = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name))
    if hits:
        return hits[0]
    sys.exit(f"{name} not found (PATH, CUDA_HOME/bin, triton's bundled tools)")


def compile_cubin(src_root: str, arch: str, out: str) -> str:
    from torch.utils.cpp_extension import include_paths

    incs = [f"-I{p}" for p in include_paths()]
    incs += [f"-I{os.path.join(src_root, 'csrc')}", f"-I{os.path.join(src_root, 'csrc', 'include')}"]
    try:
        import nvidia  # pip CUDA headers (cusparse.h), after the toolkit's as in setup.py

        for r in nvidia.__path__:
            for sub in ("cu13", "cu12"):
                if os.path.isfile(os.path.join(r, sub, "include", "cusparse.h")):
                    incs += ["-isystem", os.path.join(r, sub, "include")]
    except ImportError:
        pass
    cmd = [tool("nvcc"), "-cubin", f"-arch={arch}", "-O3", "--fmad=false", "--expt-relaxed-constexpr", "-std=c++20",
           "-Xptxas", "-v", "-DMPKERN_WITH_CUDA=1", *incs, "-o", out,
           os.path.join(src_root, "csrc", "cuda", "adamw_cuda.cu")]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        sys.exit(res.stderr[-4000:])
    return res.stderr  # ptxas -v report


def kernel_source(src_root: str) -> str:
    """The AdamW kernel's translation unit as text: adamw_cuda.cu and the adamw_*.cuh files it includes (one
    file before issue 55)."""
    cuda = Path(src_root, "csrc", "cuda")
    return "\n".join(p.read_text() for p in sorted(cuda.glob("adamw_*.cu*")))


def elems_per_iteration(src_root: str) -> int:
    text = kernel_source(src_root)
    if "adam_mom_chunk" not in text:
        return 1  # one element per lane
    ve = int(re.search(r"constexpr int kVE = (\d+);", text).group(1))
    un = re.search(r"constexpr int kMomUnroll = (\d+);", text)  # passes per iteration, if unrolled
    return ve * (int(un.group(1)) if un else 1)


def functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    out: dict[str, list[tuple[int, str]]] = {}
    cur = None
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            cur = out.setdefault(m.group(1), [])
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def loops(ins: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """The innermost loops: [target, address] of the backward branches that contain no other."""
    res = backedges(ins)
    return [lp for lp in res if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in res)]


def width(text: str) -> int:
    m = re.search(r"\b(?:LDG|STG|LD|ST)\.E(?:\.\w+)*?\.(128|64|U8|S8|U16|S16)\b", text)
    return {"128": 16, "64": 8, "U8": 1, "S8": 1, "U16": 2, "S16": 2}.get(m.group(1), 4) if m else 4


def opcode(text: str) -> str:
    """An instruction's opcode without its predicate guard."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def stats(body: list[str]) -> dict[str, int]:
    body = [t for t in body if not re.search(r"\bNOP\b", t)]
    ops = [opcode(t) for t in body]
    s = {"instructions": len(body)}
    for k in ("MUFU", "SHFL", "FCHK", "CALL"):
        s[k] = sum(o.startswith(k) for o in ops)
    # global (LDG/STG) and generic (LD/ST: addresses read from a table) accesses
    s["loads"] = sum(bool(re.match(r"LDG?\.", o)) for o in ops)
    s["stores"] = sum(bool(re.match(r"STG?\.", o)) for o in ops)
    s["load_bytes"] = sum(width(t) for t, o in zip(body, ops) if re.match(r"LDG?\.", o))
    return s


def backedges(ins: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(target, address) of every backward branch."""
    res = []
    for addr, text in ins:
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) <= addr:
            res.append((int(m.group(1), 16), addr))
    return res


def vote_split(ins: list[tuple[int, str]], lo: int, hi: int) -> list[tuple[int, int]] | None:
    """Where loop [lo, hi] votes on a pass (the compact kernels' VOTE.ALL on adamw_step_in_range's ranges)
    and branches on the vote: the address ranges of its main path (the branch taken), which skips the
    IEEE step of a pass with a value out of range. ptxas lays that block out either inside [lo, hi] (the
    main path jumps over it) or as [lo, hi]'s tail, with the main path after it closing the loop by a
    second backward branch to lo. None where the loop has no vote."""
    body = [(a, t) for a, t in ins if lo <= a <= hi]
    for k, (_, t) in enumerate(body):
        if "VOTE.ALL" not in t:
            continue
        for a, u in body[k + 1:k + 4]:
            m = re.match(r"@!?P\d\s+BRA\s+(0x[0-9a-f]+)", u)
            if not m:
                continue
            target = int(m.group(1), 16)
            spans = None
            if a < target <= hi:
                spans = [(lo, a), (target, hi)]
            latch = [b for t2, b in backedges(ins) if t2 == lo and b > target]
            if target > hi and latch:
                spans = [(lo, a), (target, min(latch))]
            if spans is None:
                break
            # the taken side must be the main path: no IEEE division check (FCHK) on it
            if any(x <= a2 <= y and "FCHK" in t2 for a2, t2 in ins for x, y in spans):
                sys.exit(f"cuda_sass_count: the vote's branch at {a:#x} leads to the IEEE step: layout not understood")
            return spans
    return None  # no vote, or a vote without a branch on it (__all_sync's fallback for a diverged warp)


def loop_body(ins: list[tuple[int, str]], lo: int, hi: int) -> list[str]:
    """The instructions a pass of loop [lo, hi] issues on its main path: where the loop votes on its
    values' ranges (vote_split), the IEEE-step block is not counted (cold_path has it)."""
    spans = vote_split(ins, lo, hi) or [(lo, hi)]
    return [t for a, t in ins if any(x <= a <= y for x, y in spans)]


def cold_path(ins: list[tuple[int, str]], lo: int, hi: int) -> list[str]:
    """The instructions of a pass that takes the IEEE-step block, where the loop votes (vote_split): up to
    the vote's branch, then the block -- to its own back edge at hi (the block as the loop's tail), or,
    inside the loop, to where it jumps (an unconditional branch at its end) or falls through -- then the
    rest of the loop; [] where the loop has no vote."""
    split = vote_split(ins, lo, hi)
    if not split:
        return []
    (_, branch), (target, _) = split
    if target > hi:  # the block is the loop's tail: [branch + 1, hi] ends with its back edge
        return [t for a, t in ins if lo <= a <= hi]
    block = [(a, t) for a, t in ins if branch < a < target]
    m = re.match(r"BRA\s+(0x[0-9a-f]+)", block[-1][1]) if block else None
    resume = int(m.group(1), 16) if m else target
    return [t for a, t in ins if lo <= a < target or resume <= a <= hi]


def staged_loops(ins: list[tuple[int, str]]) -> list[list[str]]:
    """The loops with the group-amax shuffles whose loads are shared-memory copies (LDGSTS)."""
    bodies = (loop_body(ins, lo, hi) for lo, hi in loops(ins))
    return [b for b in bodies if any("SHFL" in t for t in b) and any("LDGSTS" in t for t in b)]


def wide_loops(ins: list[tuple[int, str]]) -> list[list[str]]:
    """The loops with the group-amax shuffles and the widest global loads, smallest first: the first is
    the main loop (the aligned-grad one where there are two)."""
    cands = []
    for lo, hi in loops(ins):
        body = loop_body(ins, lo, hi)
        if any("SHFL" in t for t in body):
            cands.append((max((width(t) for t in body if re.search(r"\bLDG?\.", t)), default=0), body))
    if not cands:
        sys.exit("no loop with shuffles found")
    widest = max(w for w, _ in cands)
    return sorted((b for w, b in cands if w == widest), key=len)


def main_cold_path(ins: list[tuple[int, str]]) -> list[str]:
    """cold_path of the main loop (wide_loops' first), or []."""
    main = wide_loops(ins)[0]
    for lo, hi in loops(ins):
        if loop_body(ins, lo, hi) == main:
            return cold_path(ins, lo, hi)
    return []



def histogram(body: list[str], per: int, top: int = 24) -> str:
    """The main loop's most frequent opcodes (base name, e.g. FMUL, LOP3) per element."""
    counts: dict[str, int] = {}
    for t in body:
        if not re.search(r"\bNOP\b", t):
            op = opcode(t).split(".")[0]
            counts[op] = counts.get(op, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
    return "    " + ", ".join(f"{op} {n / per:.2f}" for op, n in ranked)


def compile_and_read(src_root: str, arch: str) -> tuple[str, dict[str, list[tuple[int, str]]], int]:
    """(ptxas -v report, the SASS functions, elements per main-loop iteration) of adamw_cuda.cu in src_root."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        ptxas = compile_cubin(src_root, arch, cubin)
        sass = subprocess.run([tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True).stdout
    return ptxas, functions(sass), elems_per_iteration(src_root)


def spilling_kernels(ptxas: str) -> int:
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas)
    return sum(1 for a, b in spills if int(a) or int(b))


def instance(funcs: dict[str, list[tuple[int, str]]], pdt: int, gdt: int, sdt: int,
             mode: int) -> list[tuple[int, str]]:
    """The instructions of one adamw_kernel instance (a row of INSTANCES)."""
    tag = f"adamw_kernelILi{pdt}ELi{gdt}ELi{sdt}ELi{mode}E"
    return funcs[next(n for n in funcs if tag in n)]


def main_loop(funcs: dict[str, list[tuple[int, str]]], pdt: int, gdt: int, sdt: int, mode: int) -> list[str]:
    """The main loop's instructions of one compact kernel instance."""
    return wide_loops(instance(funcs, pdt, gdt, sdt, mode))[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--rev", default=None, help="git revision of csrc/ (default: the working tree)")
    ap.add_argument("--ops", action="store_true", help="also print the main loop's opcodes per element")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src_root = ROOT
        if args.rev:
            src_root = os.path.join(tmp, "tree")
            os.makedirs(src_root)
            # csrc/ and the codec table it includes (mpkern/codecs.def, since issue 43 stop 48) where it exists
            has_def = subprocess.run(["git", "-C", ROOT, "cat-file", "-e", f"{args.rev}:mpkern/codecs.def"],
                                     capture_output=True, check=False).returncode == 0
            paths = ["csrc", "mpkern/codecs.def"] if has_def else ["csrc"]
            arch = subprocess.run(["git", "-C", ROOT, "archive", args.rev, *paths], capture_output=True, check=True)
            subprocess.run(["tar", "-x", "-C", src_root], input=arch.stdout, check=True)
        ptxas, funcs, per = compile_and_read(src_root, args.arch)
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", ptxas)]
    print(f"{args.rev or 'working tree'} {args.arch}: {len(regs)} kernels, {spilling_kernels(ptxas)} with spills, "
          f"registers max {max(regs)}")
    for label, *inst in INSTANCES:
        ins = instance(funcs, *inst)
        wide = wide_loops(ins)
        body = wide[0]
        s = stats(body)
        if s["FCHK"] and any("VOTE.ALL" in t for _, t in ins):
            print(f"  warning: {label}'s main loop holds the IEEE step: the vote's split was not found")
        extra = ", ".join(f"{k} {v / per:.2f}" for k, v in s.items() if k != "instructions")
        print(f"  {label:12s} main loop {s['instructions']} instr / {per} elem per thread = "
              f"{s['instructions'] / per:.1f} instr/elem  (per elem: {extra})")
        if args.ops:
            print(histogram(body, per))
        cold = main_cold_path(ins)
        if cold:
            n = stats(cold)["instructions"]
            print(f"  {'':12s} a pass with a value outside adamw_step_in_range's ranges (the IEEE step): "
                  f"{n} instr = {n / per:.1f} instr/elem")
        for other in wide[1:]:
            n = stats(other)["instructions"]
            print(f"  {'':12s} the loop for a grad at another offset: {n} instr = {n / per:.1f} instr/elem")
        for staged in staged_loops(ins):
            n = stats(staged)["instructions"]
            copies = sum("LDGSTS" in t for t in staged)
            print(f"  {'':12s} the two-stage loop (stages 2): {n} instr = {n / per:.1f} instr/elem, "
                  f"{copies} shared-memory copies per {per} elements")


if __name__ == "__main__":
    main()
