"""The SASS census of a kernel's main loops (:func:`flashtune.kernel_templates.sm90.loop_census`)
on a listing written the way ``nvdisasm -c`` prints one: no compile, no GPU."""

from __future__ import annotations

from flashtune.kernel_templates.sm90 import SECTION_MIN, loop_census


def _listing(lines: list[str]) -> str:
    """``nvdisasm -c``'s layout: labels on lines of their own, each instruction with its
    address in a comment (16 bytes apart) and a closing ``;``."""
    out, addr = [], 0
    for line in lines:
        if line.startswith(".L_x_"):
            out.append(line)
        else:
            out.append(f"        /*{addr:04x}*/                   {line} ;")
            addr += 16
    return "\n".join(out)


def _step(masked: int) -> list[str]:
    """A step of a main loop: matrix products, a barrier wait (its spin out of line, past
    the EXIT, as ptxas places it), a softmax, and a branch around ``masked``
    compare-and-select pairs (a mask's section)."""
    return (["HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT", "@!P0 BRA `(.L_x_4)",
             ".L_x_6:", "HGMMA.64x64x16.F32.BF16 R56, gdesc[UR8], RZ, !UPT",  # (back from the
             "WARPGROUP.DEPBAR.LE gsb0, 0x1",  # barrier's spin)
             "FFMA R1, R2, UR5, -R3", "MUFU.EX2 R1, R1", "@!P1 BRA P2, `(.L_x_9)"]
            + ["ISETP.GT.AND P3, PT, R0, R5, PT", "FSEL R7, R7, RZ, !P3"] * masked
            + [".L_x_9:", "F2FP.BF16.F32.PACK_AB R8, R7, R6", "STL [R1+0x8], R9",
               "LDL R9, [R1+0x8]"])


def test_the_census_counts_the_innermost_main_loops_and_their_sections() -> None:
    listing = _listing(
        ["S2R R0, SR_TID.X", ".L_x_1:",  # an outer loop (a persistent kernel's tiles)
         "IADD3 R4, R4, 0x1, RZ", ".L_x_2:"]  # the main loop
        + _step(16)
        + ["@P4 BRA `(.L_x_2)",  # its back edge
           ".L_x_3:", "IMAD R5, R5, 0x2, RZ", "@P5 BRA `(.L_x_3)",  # no HGMMA: not a main loop
           "@P6 BRA `(.L_x_1)",  # the outer loop's back edge
           "EXIT",
           ".L_x_4:", "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R12], R13",  # a barrier's spin
           "@!P1 BRA `(.L_x_4)", "BRA `(.L_x_6)", ".L_x_5:", "BRA `(.L_x_5)"])
    loops = loop_census(listing)
    assert len(loops) == 1, loops  # not the outer loop, not the spin's jump back into it
    (loop,) = loops
    assert loop["instructions"] == 7 + 2 * 16 + 3 + 1  # the step and its back edge
    assert loop["opcodes"] == {"HGMMA": 2, "MUFU": 1, "FFMA": 1, "FSEL": 16, "ISETP": 16,
                               "F2FP": 1, "LDL": 1, "STL": 1}
    (section,) = loop["sections"]
    assert section["instructions"] == 2 * 16
    assert section["opcodes"] == {"FSEL": 16, "ISETP": 16}


def test_a_short_forward_branch_is_no_section() -> None:
    few = (SECTION_MIN - 1) // 2  # a branch over fewer instructions than SECTION_MIN
    listing = _listing([".L_x_2:"] + _step(few) + ["@P4 BRA `(.L_x_2)", "EXIT", ".L_x_4:",
                                                    "BRA `(.L_x_6)"])
    (loop,) = loop_census(listing)
    assert loop["sections"] == []
    assert loop["opcodes"]["FSEL"] == few
