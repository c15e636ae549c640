"""cgroup v2's device fence (worker_agent.device_bpf): the program's decisions, read by a
small interpreter of the six instructions it uses (so the jump offsets are checked on any
machine); the kernel's own verdicts are in tests/security/test_device_fence_v2.py."""

from __future__ import annotations

import struct

import pytest

from worker_agent import device_bpf

CHAR, BLOCK = 2, 1
READ, WRITE, MKNOD = 2, 4, 1


def run(code: bytes, dev_type: int, major: int, minor: int, access: int = READ | WRITE) -> int:
    """Execute the program on one bpf_cgroup_dev_ctx; its return value (1 allow, 0 deny)."""
    ctx = struct.pack("<III", access << 16 | dev_type, major, minor)
    insns = [struct.unpack_from("<BBhi", code, i) for i in range(0, len(code), 8)]
    regs = [0] * 11
    pc = 0
    for _ in range(10_000):
        op, regs_byte, off, imm = insns[pc]
        dst, src = regs_byte & 0xF, regs_byte >> 4
        pc += 1
        if op == 0x61:  # dst = *(u32 *)(ctx + off); r1 holds the context, nothing else is read
            assert src == 1, "the program reads only its context"
            regs[dst] = struct.unpack_from("<I", ctx, off)[0]
        elif op == 0x57:
            regs[dst] &= imm
        elif op == 0xB7:
            regs[dst] = imm
        elif op == 0x55:
            pc += off if regs[dst] != imm else 0
        elif op == 0x05:
            pc += off
        elif op == 0x95:
            return regs[0]
        else:
            raise AssertionError(f"unexpected instruction {op:#x}")
        assert 0 <= pc < len(insns), "a jump left the program"
    raise AssertionError("no exit")


def test_only_the_listed_character_devices_are_denied():
    code = device_bpf.program([(195, 0), (195, 2), (195, 3)])
    for minor in (0, 2, 3):
        for access in (READ, WRITE, MKNOD, READ | WRITE | MKNOD):
            assert run(code, CHAR, 195, minor, access) == 0
    assert run(code, CHAR, 195, 1) == 1  # the rank's own GPU
    assert run(code, CHAR, 195, 255) == 1  # nvidiactl
    assert run(code, CHAR, 510, 0) == 1  # nvidia-uvm (its major is dynamic, never a GPU's)
    assert run(code, CHAR, 1, 3) == 1  # /dev/null
    assert run(code, BLOCK, 195, 0) == 1  # a block device with the same numbers is not a GPU
    assert run(code, CHAR, 194, 0) == 1 and run(code, CHAR, 196, 2) == 1


def test_each_entry_is_matched_by_major_and_minor_together():
    code = device_bpf.program([(195, 7), (10, 1)])
    assert run(code, CHAR, 195, 7) == 0 and run(code, CHAR, 10, 1) == 0
    assert run(code, CHAR, 195, 1) == 1 and run(code, CHAR, 10, 7) == 1


def test_an_empty_list_allows_everything_and_duplicates_are_one_entry():
    code = device_bpf.program([])
    assert all(run(code, t, 195, m) == 1 for t in (CHAR, BLOCK) for m in range(4))
    assert device_bpf.program([(195, 1), (195, 1)]) == device_bpf.program([(195, 1)])


@pytest.mark.parametrize("gpus", [1, 8, 64])
def test_every_gpu_of_a_large_node_is_decided(gpus):
    denied = [(195, m) for m in range(gpus) if m % 3]
    code = device_bpf.program(denied)
    for m in range(gpus + 1):
        assert run(code, CHAR, 195, m) == (0 if (195, m) in denied else 1)


def test_a_device_number_out_of_range_is_refused():
    with pytest.raises(ValueError, match="out of range"):
        device_bpf.program([(195, -1)])
