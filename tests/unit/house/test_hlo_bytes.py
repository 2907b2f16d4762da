"""``benchmarks.hlo_bytes`` counts a program's HBM traffic from its optimised HLO: memory space 0
only, a ``copy-start``'s VMEM copy and source alias not counted as traffic, fused slices by the
slice, in-place updates by the update, a layer loop's body times its trip count."""

from __future__ import annotations

from benchmarks import hlo_bytes

# A 4-layer loop whose body reads one layer of a stacked weight (dynamic-slice inside a fusion)
# with the activation staged in VMEM (S(1)); the entry stages x into VMEM with copy-start and
# writes one row of a cache in place.
HLO = """HloModule m

%fused_dot (p0: bf16[4,64,32], p1: s32[], p2: bf16[64]) -> bf16[32] {
  %p0 = bf16[4,64,32]{2,1,0} parameter(0)
  %p1 = s32[]{:S(6)} parameter(1)
  %z = s32[]{:S(6)} constant(0)
  %ds = bf16[1,64,32]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,64,32}
  %b = bf16[64,32]{1,0} bitcast(%ds)
  %p2 = bf16[64]{0:S(1)} parameter(2)
  ROOT %d = bf16[32]{0:S(1)} dot(%p2, %b), lhs_contracting_dims={0}, rhs_contracting_dims={0}
}

%body (t: (s32[], bf16[64], bf16[4,64,32])) -> (s32[], bf16[64], bf16[4,64,32]) {
  %t = (s32[]{:S(6)}, bf16[64]{0:S(1)}, bf16[4,64,32]{2,1,0}) parameter(0)
  %i = s32[]{:S(6)} get-tuple-element(%t), index=0
  %h = bf16[64]{0:S(1)} get-tuple-element(%t), index=1
  %w = bf16[4,64,32]{2,1,0} get-tuple-element(%t), index=2
  %f = bf16[32]{0:S(1)} fusion(%w, %i, %h), kind=kOutput, calls=%fused_dot
  %one = s32[]{:S(6)} constant(1)
  %j = s32[]{:S(6)} add(%i, %one)
  ROOT %r = (s32[]{:S(6)}, bf16[64]{0:S(1)}, bf16[4,64,32]{2,1,0}) tuple(%j, %h, %w)
}

%cond (t: (s32[], bf16[64], bf16[4,64,32])) -> pred[] {
  %t = (s32[]{:S(6)}, bf16[64]{0:S(1)}, bf16[4,64,32]{2,1,0}) parameter(0)
  %i = s32[]{:S(6)} get-tuple-element(%t), index=0
  %n = s32[]{:S(6)} constant(4)
  ROOT %lt = pred[]{:S(6)} compare(%i, %n), direction=LT
}

ENTRY %main (w: bf16[4,64,32], x: bf16[64], k: bf16[16,128], row: bf16[1,128]) -> bf16[16,128] {
  %w = bf16[4,64,32]{2,1,0} parameter(0)
  %x = bf16[64]{0} parameter(1)
  %k = bf16[16,128]{1,0} parameter(2)
  %row = bf16[1,128]{1,0} parameter(3)
  %cs = (bf16[64]{0:S(1)}, bf16[64]{0}, u32[]{:S(2)}) copy-start(%x)
  %cd = bf16[64]{0:S(1)} copy-done(%cs)
  %zero = s32[]{:S(6)} constant(0)
  %t = (s32[]{:S(6)}, bf16[64]{0:S(1)}, bf16[4,64,32]{2,1,0}) tuple(%zero, %cd, %w)
  %loop = (s32[]{:S(6)}, bf16[64]{0:S(1)}, bf16[4,64,32]{2,1,0}) while(%t), condition=%cond, body=%body
  ROOT %u = bf16[16,128]{1,0} dynamic-update-slice(%k, %row, %zero, %zero)
}
"""


def test_hbm_bytes_count_each_layer_once_and_skip_vmem_staging():
    got = hlo_bytes.hbm_bytes(HLO)
    layer = 64 * 32 * 2  # one layer of the stacked weight, read from HBM by the loop body
    x = 64 * 2  # read from HBM once by copy-start; its VMEM copy and source alias are not traffic
    row = 128 * 2  # the in-place cache update: the update read, the row written
    assert got["hbm"] == 4 * layer + x + 2 * row
    assert got["staged"] == x
    # every memory space: the VMEM copy written, its alias, the VMEM reads and writes of the body
    assert got["all_spaces"] > got["hbm"]


def test_trip_count_is_the_loop_bound_and_a_runtime_bound_counts_once():
    assert hlo_bytes.Module(HLO).multiplier == {"main": 1, "body": 4}
    runtime = HLO.replace("%n = s32[]{:S(6)} constant(4)", "%n = s32[]{:S(6)} get-tuple-element(%t), index=0")
    assert hlo_bytes.Module(runtime).multiplier["body"] == 1
    # the GPU compiler names the count in the loop's backend config
    known = runtime.replace("body=%body", 'body=%body, backend_config={"known_trip_count":{"n":"7"}}')
    assert hlo_bytes.Module(known).multiplier["body"] == 7
