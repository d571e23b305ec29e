"""The emulated AMX tile unit (cpu_kernels.c, SPECSERVE_AMX_EMULATE; the test level
``build.EMULATED_AMX_LEVEL``), on which the AMX paths' tests run where the CPU has no
tiles (tests/engine/kernel_levels.py). Its instructions against a plain scalar
reference of the instruction's definition, in a C program that includes the kernels'
source (so it calls the emulator's own functions): tdpbssd's exact int32 sums with
wrap-around, tdpbf16ps's pairs in order with subnormals read as zero and flushed,
partial tiles (fewer rows, fewer columns, a shorter K) read and stored at any stride;
each fault the tile unit would raise stops the process with one line; the emulated
build has no tile instruction, claims no AMX peak, and is no level a CPU is served
with. Where the CPU has AMX, the emulated build's results are its tiles' bits."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from engine.kernels import build as build_mod
from engine.kernels.cpu import CpuKernels, cpu_kernels
from engine.kernels.quant import FORMATS, QuantOps

pytestmark = pytest.mark.skipif(
    not build_mod.emulated_amx_runnable(),
    reason="the emulated AMX level needs AVX512-BF16 and VNNI (this CPU lacks them)",
)

PROGRAM = r"""
#include "kernels.c"

/* A deterministic stream of bytes. */
static uint32_t rng = 12345u;
static uint32_t next(void) { rng = rng * 1664525u + 1013904223u; return rng >> 8; }

static void config(int m, int kb, int n4) {
    /* C 0: m x n4 dwords, A 1: m x kb bytes, B 2: kb / 4 x n4 dwords; 3-5 the same */
    struct amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 6; t += 3) {
        cfg.rows[t] = (uint8_t)m, cfg.colsb[t] = (uint16_t)(4 * n4);
        cfg.rows[t + 1] = (uint8_t)m, cfg.colsb[t + 1] = (uint16_t)kb;
        cfg.rows[t + 2] = (uint8_t)(kb / 4), cfg.colsb[t + 2] = (uint16_t)(4 * n4);
    }
    _tile_loadconfig(&cfg);
}

/* bf16 bits -> float, a subnormal read as zero (its sign kept) */
static float daz(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
    return BITS_TO_F32(u);
}
static float ftz(float x) {
    uint32_t u = F32_TO_BITS(x);
    if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
    return BITS_TO_F32(u);
}

static int check_int8(int m, int kb, int n4, int astride, int cstride) {
    int8_t a[16 * 128], b[16 * 128];
    int32_t c[16 * 64], want[16 * 64];
    for (int i = 0; i < 16 * 128; i++) a[i] = (int8_t)next(), b[i] = (int8_t)next();
    for (int i = 0; i < 16 * 64; i++) c[i] = (int32_t)(next() * 2654435761u);
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n4; j++) {
            uint32_t v = (uint32_t)c[i * cstride / 4 + j];
            for (int p = 0; p < kb / 4; p++)
                for (int q = 0; q < 4; q++)
                    v += (uint32_t)((int32_t)a[i * astride + 4 * p + q] *
                                    (int32_t)b[p * 64 + 4 * j + q]);
            want[i * 16 + j] = (int32_t)v;
        }
    config(m, kb, n4);
    _tile_loadd(0, c, cstride);
    _tile_loadd(1, a, astride);
    _tile_loadd(2, b, 64);
    _tile_dpbssd(0, 1, 2);
    int32_t got[16 * 64];
    memset(got, 0x5a, sizeof got);
    _tile_stored(0, got, 64);
    _tile_release();
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 16; j++) {
            const int in = i < m && j < n4;
            if (in && got[i * 16 + j] != want[i * 16 + j]) return 1;
            if (!in && got[i * 16 + j] != 0x5a5a5a5a) return 2; /* stored past its size */
        }
    return 0;
}

/* bf16 values around 1, and among them subnormals (read as zero) and values near the
 * least normal, whose products and sums fall below it (flushed) */
static uint16_t some_bf16(int tiny) {
    const uint32_t r = next();
    if (r % 8 == 0) return (uint16_t)(r & 0x807f); /* subnormal or zero */
    const uint32_t exp = tiny ? 1 + (r >> 12) % 4 : 120 + (r >> 12) % 16;
    return (uint16_t)(((r >> 3) & 0x807f) | (exp << 7));
}

static int check_bf16(int m, int kb, int n4, int tiny) {
    uint16_t a[16 * 32], b[16 * 32];
    float c[16 * 16], want[16 * 16], got[16 * 16];
    /* tiny: A near the least normal, B around 1 (2^-7 to 2^8) */
    for (int i = 0; i < 16 * 32; i++) a[i] = some_bf16(tiny), b[i] = some_bf16(0);
    for (int i = 0; i < 16 * 16; i++)
        c[i] = tiny ? 0.0f : (float)(int32_t)(next() % 2001 - 1000) / 4096.0f;
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n4; j++) {
            float acc = c[i * 16 + j];
            for (int p = 0; p < kb / 4; p++) {
                acc = ftz(fmaf(daz(a[i * 32 + 2 * p]), daz(b[p * 32 + 2 * j]), acc));
                acc = ftz(fmaf(daz(a[i * 32 + 2 * p + 1]), daz(b[p * 32 + 2 * j + 1]), acc));
            }
            want[i * 16 + j] = acc;
        }
    config(m, kb, n4);
    _tile_loadd(3, c, 64);
    _tile_loadd(4, a, 64);
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(3, 4, 5);
    _tile_stored(3, got, 64);
    _tile_release();
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n4; j++)
            if (F32_TO_BITS(got[i * 16 + j]) != F32_TO_BITS(want[i * 16 + j])) return 1;
    return 0;
}

int main(int argc, char **argv) {
    const char *what = argc > 1 ? argv[1] : "";
    if (!strcmp(what, "values")) {
        int bad = 0;
        /* full tiles, and partial ones: rows, output columns, K; strides wider than rows */
        const int shapes[][3] = {{16, 64, 16}, {1, 64, 16}, {5, 32, 16}, {16, 4, 1},
                                 {7, 12, 3},  {16, 64, 9}, {2, 20, 13}};
        for (int s = 0; s < 7; s++) {
            bad |= check_int8(shapes[s][0], shapes[s][1], shapes[s][2], 128, 256) << (2 * s);
            for (int tiny = 0; tiny < 2; tiny++)
                bad |= check_bf16(shapes[s][0], shapes[s][1], shapes[s][2], tiny) << (16 + s);
        }
        printf("%d\n", bad);
        return 0;
    }
    int8_t buf[16 * 64] = {0};
    if (!strcmp(what, "unconfigured")) _tile_zero(0);
    if (!strcmp(what, "too-many-rows")) {
        struct amx_tilecfg cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1, cfg.rows[0] = 17, cfg.colsb[0] = 64;
        _tile_loadconfig(&cfg);
    }
    if (!strcmp(what, "shapes")) {
        config(16, 64, 16);
        _tile_dpbssd(0, 4, 2); /* A of another K than B's rows: fine; then a mismatch */
        struct amx_tilecfg cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        cfg.rows[0] = 16, cfg.colsb[0] = 64, cfg.rows[1] = 16, cfg.colsb[1] = 32;
        cfg.rows[2] = 16, cfg.colsb[2] = 64; /* B: 16 rows, but A's K is 8 dwords */
        _tile_loadconfig(&cfg);
        _tile_dpbssd(0, 1, 2);
    }
    if (!strcmp(what, "reserved")) {
        struct amx_tilecfg cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1, cfg.reserved[3] = 1, cfg.rows[0] = 16, cfg.colsb[0] = 64;
        _tile_loadconfig(&cfg);
    }
    if (!strcmp(what, "same-tile")) {
        config(16, 64, 16);
        _tile_dpbf16ps(0, 1, 1);
    }
    if (!strcmp(what, "released")) {
        config(16, 64, 16);
        _tile_release();
        _tile_loadd(1, buf, 64);
    }
    printf("no fault\n");
    return 0;
}
"""


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    """The program above, built at the emulated level's flags."""
    cc = build_mod._compiler()
    if cc is None:
        pytest.fail("no C compiler (CI machines have gcc)")
    out = tmp_path_factory.mktemp("amx-emulator")
    (out / "kernels.c").write_bytes(build_mod.read_source())
    (out / "main.c").write_text(PROGRAM)
    flags = build_mod._compile_flags(build_mod.EMULATED_AMX_LEVEL)
    flags = [f for f in flags if f != "-O3"] + ["-O1"]  # the kernels' code, compiled faster
    cmd = [cc, *flags, "main.c", "-o", "emulator", "-lm"]
    result = subprocess.run(cmd, cwd=out, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    return out / "emulator"


def _run(emulator, what: str) -> subprocess.CompletedProcess:
    return subprocess.run([emulator, what], capture_output=True, text=True, timeout=60)


def test_the_emulated_instructions_are_their_definitions(emulator):
    """tdpbssd and tdpbf16ps against scalar references, bit for bit, on full and
    partial tiles: 0 means every shape matched (a bit set names the shape that did
    not, or a store that wrote past its tile's columns or rows)."""
    result = _run(emulator, "values")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0"


FAULTS = ["unconfigured", "too-many-rows", "reserved", "shapes", "same-tile", "released"]


@pytest.mark.parametrize("fault", FAULTS)
def test_what_the_tile_unit_faults_on_stops_the_process(emulator, fault):
    """A tile used before any configuration or after its release, a configuration past
    16 rows or with a reserved byte set, a product whose shapes do not fit, a tile named
    twice in a product."""
    result = _run(emulator, fault)
    assert result.returncode != 0 and "no fault" not in result.stdout, fault
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specserve AMX emulation: ")
    assert lines[0].endswith("the tile unit would fault")


@pytest.fixture(scope="module")
def emulated(prebuilt_kernel_levels) -> CpuKernels:
    return CpuKernels(prebuilt_kernel_levels[build_mod.EMULATED_AMX_LEVEL])


def test_the_emulated_build_says_so_and_claims_no_amx_peak(emulated):
    """Its tiles are in use (amx_tiles 2) and emulated; `bench bounds` measures no
    tdpbssd or tdpbf16ps peak from it (-1: not this build's), where its AVX-512 peaks
    are measured as in any build."""
    assert emulated.amx_tiles == 2 and emulated.amx_emulated
    assert "amx" in emulated.bf16_linear_modes
    assert emulated._peak_gmacs(4, 1000, 1) == -1.0  # tdpbssd
    assert emulated._peak_gmacs(5, 1000, 1) == -1.0  # tdpbf16ps
    assert emulated._peak_gmacs(0, 1000, 1) > 0  # fp32 FMA
    native = cpu_kernels()
    assert native is not None and not native.amx_emulated


def test_the_emulated_level_is_never_served():
    """Not a prebuilt level (a CPU is never served with it, nor the container image
    built with it), nor one SPECSERVE_KERNEL_LEVEL accepts."""
    names = [level for level, _ in build_mod.PREBUILT_LEVELS[build_mod.platform.machine()]]
    assert build_mod.EMULATED_AMX_LEVEL not in names
    with pytest.raises(build_mod.KernelBuildError, match="not a kernel level"):
        build_mod.level_flags(build_mod.EMULATED_AMX_LEVEL)


def _disassembly(path) -> str:
    # a private build is /proc/self/fd/N: this process's, named by its pid for objdump
    name = str(path).replace("/proc/self/", f"/proc/{os.getpid()}/")
    dump = subprocess.run(["objdump", "-d", name], capture_output=True, text=True)
    if dump.returncode != 0:
        pytest.fail(f"objdump failed: {dump.stderr.strip()[:200]}")
    return dump.stdout


def test_the_emulated_build_has_no_tile_instruction(prebuilt_kernel_levels):
    """Its code runs on any AVX512-BF16 CPU: no AMX opcode in it (objdump's names),
    where the AMX level's build has them."""
    emulated = _disassembly(prebuilt_kernel_levels[build_mod.EMULATED_AMX_LEVEL])
    for opcode in ("ldtilecfg", "tileloadd", "tilestored", "tilezero", "tdpb", "tilerelease"):
        assert opcode not in emulated, opcode
    real = _disassembly(prebuilt_kernel_levels["x86-64-v4-amx"])
    assert "tdpbssd" in real and "tdpbf16ps" in real  # what the check above would see


def test_on_a_cpu_with_amx_the_emulation_gives_its_tiles_bits(emulated):
    """Where the CPU lends its tiles: the quantized Linear on the int8 tiles and the
    bf16 tile path, and the bf16 Linear on tiles, give the same bits emulated as on the
    hardware (the emulation is what the tests of those paths run elsewhere)."""
    native = cpu_kernels()
    if native is None or native.amx_tiles != 2:
        pytest.skip("no AMX tiles on this CPU to compare the emulation with")
    gen = torch.Generator().manual_seed(3)
    import gguf
    import numpy as np

    weight = torch.randn(80, 192, generator=gen)
    x = torch.randn(40, 192, generator=gen)
    for name in ("Q8_0", "Q4_1"):
        kind = getattr(gguf.GGMLQuantizationType, name)
        rows = torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(weight.numpy(), kind)))
        outs = []
        for kernels in (native, emulated):
            ops = QuantOps(kernels.lib)
            packed = ops.pack(FORMATS[name], rows, 192)
            rule, bf16 = ops.amx_min_rows, ops.bf16_min_rows
            try:
                ops.set_amx_min_rows(1)
                on_int8 = ops.linear(x, packed, None)
                ops.set_bf16_min_rows(1)
                outs.append((on_int8, ops.linear(x, packed, None)))
            finally:
                ops.set_amx_min_rows(rule)
                ops.set_bf16_min_rows(bf16)
        assert torch.equal(outs[0][0], outs[1][0]), name
        assert torch.equal(outs[0][1], outs[1][1]), name
    w16 = (weight / 8).to(torch.bfloat16)
    x16 = x.to(torch.bfloat16)
    outs = []
    for kernels in (native, emulated):
        before = kernels.set_bf16_linear("amx")
        try:
            outs.append(kernels.linear(x16, kernels.pack_linear_weight(w16), None, 80))
        finally:
            kernels.set_bf16_linear(before)
    assert torch.equal(outs[0], outs[1])
