"""cgroup v2's device fence: a BPF program that denies a cgroup's processes some device nodes.

cgroup v2 has no ``devices.deny`` file; the kernel asks a program of type
``BPF_PROG_TYPE_CGROUP_DEVICE`` attached to the cgroup (and those attached above it) on
every open and mknod of a device node. runc and systemd fence containers this way. The
program here allows every device but the listed character devices (the GPUs beside a
rank's own, worker_agent.gpu_devices), so the shared nodes CUDA needs stay open.

It is attached with ``BPF_PROG_ATTACH`` and ``BPF_F_ALLOW_MULTI``: the cgroup holds the
program once attached (it outlives the supervisor that loaded it, and goes with the
cgroup), and a program an ancestor holds (systemd's device policy for the slice) still
runs beside it, so neither loosens the other.

``program`` is pure (the instructions, testable anywhere); ``deny`` and ``attached`` call
the kernel. Standard library only (the supervisor imports it)."""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
from collections.abc import Iterable
from pathlib import Path

# include/uapi/linux/bpf.h
_BPF_PROG_LOAD = 5
_BPF_PROG_ATTACH = 8
_BPF_PROG_QUERY = 16
_BPF_PROG_TYPE_CGROUP_DEVICE = 15
_BPF_CGROUP_DEVICE = 6  # attach type
_BPF_F_ALLOW_MULTI = 2
_BPF_DEVCG_DEV_CHAR = 2  # bpf_cgroup_dev_ctx.access_type's low half
_SYSCALL_NUMBERS = {"x86_64": 321, "aarch64": 280, "arm64": 280}
_LICENSE = b"Apache-2.0\0"  # the program calls no GPL-only helper

# instruction classes and operations (one 8-byte instruction each: code, dst|src<<4, off, imm)
_LDX_MEM_W = 0x61  # dst = *(u32 *)(src + off)
_ALU64_AND_K = 0x57  # dst &= imm
_ALU64_MOV_K = 0xB7  # dst = imm
_JMP_JNE_K = 0x55  # if dst != imm: pc += off
_JMP_JA = 0x05  # pc += off
_JMP_EXIT = 0x95


class DeviceFenceError(OSError):
    pass


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def program(denied: Iterable[tuple[int, int]]) -> bytes:
    """The instructions: 1 (allow) unless the device is a character device listed by
    (major, minor), then 0 (deny, whatever the access: read, write or mknod).

    The context (r1) is ``struct bpf_cgroup_dev_ctx {u32 access_type; u32 major; u32 minor}``,
    ``access_type`` being ``access << 16 | type``."""
    entries = sorted(set((int(a), int(b)) for a, b in denied))
    for major, minor in entries:
        if not (0 <= major < 2**31 and 0 <= minor < 2**31):
            raise ValueError(f"device number {major}:{minor} out of range")
    if not entries:  # allow everything (the verifier refuses a deny branch nothing reaches)
        return _insn(_ALU64_MOV_K, dst=0, imm=1) + _insn(_JMP_EXIT)
    head = [
        _insn(_LDX_MEM_W, dst=2, src=1, off=0),  # r2 = access_type
        _insn(_ALU64_AND_K, dst=2, imm=0xFFFF),  # r2 = the device's type
        None,  # if r2 != char: allow (patched below, once the length is known)
        _insn(_LDX_MEM_W, dst=3, src=1, off=4),  # r3 = major
        _insn(_LDX_MEM_W, dst=4, src=1, off=8),  # r4 = minor
    ]
    body: list[bytes] = []
    n = len(entries)
    for i, (major, minor) in enumerate(entries):
        # this entry's three instructions, then the entries after it, then allow (2), deny (2)
        to_deny = 3 * (n - i - 1) + 2
        body += [
            _insn(_JMP_JNE_K, dst=3, off=2, imm=major),  # not this major: the next entry
            _insn(_JMP_JNE_K, dst=4, off=1, imm=minor),  # not this minor: the next entry
            _insn(_JMP_JA, off=to_deny),
        ]
    tail = [
        _insn(_ALU64_MOV_K, dst=0, imm=1),  # allow
        _insn(_JMP_EXIT),
        _insn(_ALU64_MOV_K, dst=0, imm=0),  # deny
        _insn(_JMP_EXIT),
    ]
    head[2] = _insn(_JMP_JNE_K, dst=2, off=2 + len(body), imm=_BPF_DEVCG_DEV_CHAR)
    return b"".join([*head, *body, *tail])  # type: ignore[list-item]


def _bpf(cmd: int, attr: ctypes.Array) -> int:
    number = _SYSCALL_NUMBERS.get(platform.machine())
    if number is None:
        raise DeviceFenceError(errno.ENOSYS, f"no bpf system call number known for {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    out = libc.syscall(ctypes.c_long(number), ctypes.c_long(cmd), attr, ctypes.c_long(len(attr)))
    if out < 0:
        err = ctypes.get_errno()
        raise DeviceFenceError(err, os.strerror(err))
    return int(out)


def _load(denied: Iterable[tuple[int, int]]) -> int:
    """Load the program; its file descriptor."""
    code = program(denied)
    insns = ctypes.create_string_buffer(code, len(code))
    license_buf = ctypes.create_string_buffer(_LICENSE, len(_LICENSE))
    attr = ctypes.create_string_buffer(128)
    struct.pack_into(
        "<IIQQ", attr, 0, _BPF_PROG_TYPE_CGROUP_DEVICE, len(code) // 8, ctypes.addressof(insns),
        ctypes.addressof(license_buf),
    )  # fmt: skip
    struct.pack_into("<16s", attr, 48, b"gpufleet_gpus")  # prog_name, for bpftool's listing
    struct.pack_into("<I", attr, 68, _BPF_CGROUP_DEVICE)  # expected_attach_type
    try:
        return _bpf(_BPF_PROG_LOAD, attr)
    except DeviceFenceError as e:
        raise DeviceFenceError(e.errno, f"cannot load the device program: {e.strerror}") from None


def deny(cgroup_dir: Path | str, denied: Iterable[tuple[int, int]]) -> None:
    """Attach a program denying these character devices to a cgroup v2 dir (before any of
    the rank's processes enter it)."""
    prog = _load(denied)
    try:
        target = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            attr = ctypes.create_string_buffer(struct.pack("<IIIII", target, prog, _BPF_CGROUP_DEVICE,
                                                           _BPF_F_ALLOW_MULTI, 0), 20)  # fmt: skip
            try:
                _bpf(_BPF_PROG_ATTACH, attr)
            except DeviceFenceError as e:
                raise DeviceFenceError(
                    e.errno, f"cannot attach the device program to {cgroup_dir}: {e.strerror}"
                ) from None
        finally:
            os.close(target)
    finally:
        os.close(prog)  # the cgroup keeps the attached program


def attached(cgroup_dir: Path | str) -> int:
    """How many device programs are attached to this cgroup itself (not its ancestors)."""
    target = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        attr = ctypes.create_string_buffer(40)
        struct.pack_into("<III", attr, 0, target, _BPF_CGROUP_DEVICE, 0)
        _bpf(_BPF_PROG_QUERY, attr)
        return struct.unpack_from("<I", attr, 24)[0]  # prog_cnt
    finally:
        os.close(target)
