"""A rank's share of its node (worker_agent.rank_limits), the container engine's flags that
carry it, the cgroup files the process runtime writes for it (a cgroup v2 tree is stood in
for by a directory here; tests/security/test_rank_fence.py uses the real ones), and the
work-dir disk share its supervisor measures (worker_agent.rank_disk)."""

from __future__ import annotations

import os
import stat

import pytest

from tests.agent.conftest import close_node, make_settings, start_task, wait_for
from worker_agent import exit_cause, gpu_devices, rank_cgroup
from worker_agent import statefiles as sf
from worker_agent.node import NodeAgent
from worker_agent.nvml import make_backend
from worker_agent.rank_disk import dir_bytes
from worker_agent.rank_limits import RankLimits, node_rank_limits, rank_limits
from worker_agent.runtime import ContainerRuntime

GIB = 1 << 30
MIB = 1 << 20


@pytest.mark.parametrize(
    "gpus, node_gpus, cpus, memory_gib, reserved_cpus, reserved_gib, want_cpus, want_memory",
    [
        (1, 8, 96, 1024, 2, 8, 11.75, 127 * GIB),  # (96 - 2) / 8 CPUs, (1024 - 8) / 8 GiB
        (8, 8, 96, 1024, 2, 8, 94, 1016 * GIB),  # the whole node: all but the reserve
        (3, 8, 96, 1024, 2, 8, 35.25, 381 * GIB),
        (1, 8, 2, 24, 2, 8, 0.12, 2 * GIB),  # a small host: the reserve takes at most half
        (1, 4, 64, 512, 0, 0, 16, 128 * GIB),  # nothing reserved
        (16, 8, 96, 1024, 2, 8, 94, 1016 * GIB),  # more GPUs than the node has: still the node
    ],
)
def test_the_share_is_the_node_less_its_reserve_split_by_gpus(
    gpus, node_gpus, cpus, memory_gib, reserved_cpus, reserved_gib, want_cpus, want_memory
):
    got = rank_limits(
        gpus=gpus, node_gpus=node_gpus, node_cpus=cpus, node_memory_bytes=memory_gib * GIB,
        reserved_cpus=reserved_cpus, reserved_memory_bytes=reserved_gib * GIB, pids_max=4096,
    )  # fmt: skip
    assert got == RankLimits(cpus=want_cpus, memory_bytes=want_memory, pids=4096)


def test_memory_is_whole_mebibytes_and_a_node_without_resources_is_refused():
    odd = rank_limits(gpus=1, node_gpus=3, node_cpus=1, node_memory_bytes=GIB, reserved_cpus=0,
                      reserved_memory_bytes=0, pids_max=64)  # fmt: skip
    assert odd.memory_bytes % MIB == 0 and odd.memory_bytes == 341 * MIB
    with pytest.raises(ValueError):
        rank_limits(gpus=1, node_gpus=8, node_cpus=0, node_memory_bytes=GIB, reserved_cpus=0,
                    reserved_memory_bytes=0, pids_max=64)  # fmt: skip


def test_settings_give_the_share_or_none(tmp_path):
    s = make_settings(tmp_path, agent_node_cpus=34, agent_node_memory_gib=72, agent_node_reserved_cpus=2,
                      agent_node_reserved_memory_gib=8, agent_rank_pids_max=1000)  # fmt: skip
    assert node_rank_limits(s, gpus=2, node_gpus=8) == RankLimits(cpus=8.0, memory_bytes=16 * GIB, pids=1000)
    assert node_rank_limits(s.model_copy(update={"agent_rank_limits": False}), gpus=2, node_gpus=8) is None
    host = node_rank_limits(make_settings(tmp_path), gpus=8, node_gpus=8)  # this host's CPUs and memory
    assert host is not None and host.cpus > 0 and host.memory_bytes >= MIB


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("engine", ["docker", "podman"])
def test_the_container_carries_its_share_and_a_private_ipc_namespace(engine):
    t = start_task("n", "lease-9", ["python", "train.py"], gpus=(0, 1))
    limits = RankLimits(cpus=11.75, memory_bytes=127 * GIB, pids=4096)
    argv = ContainerRuntime(engine).launch(t, progress_file="/s/rank/progress.json", host_env={}, limits=limits).argv
    assert flag(argv, "--cpus") == "11.75"
    assert flag(argv, "--memory") == flag(argv, "--memory-swap") == "130048m"  # no swap beyond it
    assert flag(argv, "--shm-size") == "130048m"  # /dev/shm is charged to the same memory
    assert flag(argv, "--pids-limit") == "4096"
    assert flag(argv, "--ipc") == "private" and flag(argv, "--security-opt") == "no-new-privileges"
    assert argv.index("--pids-limit") < argv.index("registry/test:1")  # engine flags, not the job's arguments
    launch = ContainerRuntime(engine).launch(t, progress_file="/s/rank/progress.json", host_env={}, limits=limits)
    assert (launch.env["GPUFLEET_CPUS"], launch.env["GPUFLEET_MEMORY_BYTES"]) == ("11.75", str(127 * GIB))
    assert {"GPUFLEET_CPUS", "GPUFLEET_MEMORY_BYTES"} <= {argv[i + 1] for i, a in enumerate(argv) if a == "-e"}
    bare = ContainerRuntime(engine).launch(t, progress_file="/s/rank/progress.json", host_env={}).argv
    assert not {"--cpus", "--memory", "--pids-limit"} & set(bare)


async def test_the_node_gives_a_container_its_gpus_share(tmp_path):
    settings = make_settings(tmp_path, agent_node_cpus=66, agent_node_memory_gib=264, agent_node_reserved_cpus=2,
                             agent_node_reserved_memory_gib=8, agent_rank_pids_max=2048)  # fmt: skip
    node = NodeAgent(settings, "node-c", backend=make_backend(settings, "node-c", "simulated"),
                     runtime=ContainerRuntime("docker"))  # fmt: skip
    await node.start()
    try:
        # no engine here: the rank fails to start (exit 127), after its command line is written
        res = await node.start_task(start_task("node-c", "lease-c", ["train"], gpus=(4, 5, 6, 7)))
        assert res.accepted or "start" in res.reason
        spec = sf.read_json(node.leases["lease-c"].dir / sf.SPEC)
        assert (flag(spec["argv"], "--cpus"), flag(spec["argv"], "--memory")) == ("32", f"{128 * 1024}m")
        assert flag(spec["argv"], "--pids-limit") == "2048"
        assert spec["cgroup"] is None  # the engine fences a container; the supervisor makes no cgroup
        await wait_for(lambda: not node.leases["lease-c"].live, what="the engine-less rank to end")
    finally:
        await node.close()


async def test_an_agent_asked_for_cgroups_it_cannot_make_refuses_to_start(tmp_path):
    settings = make_settings(tmp_path, agent_rank_cgroups=True, agent_cgroup_root=tmp_path / "no-cgroups")
    node = NodeAgent(settings, "node-x", backend=make_backend(settings, "node-x", "simulated"))
    with pytest.raises(RuntimeError, match="agent_rank_cgroups is on but ranks cannot be fenced"):
        await node.start()


def fake_v2(tmp_path):
    root = tmp_path / "cgroup2"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids rdma misc\n")
    (root / "cgroup.subtree_control").write_text("cpu memory\n")
    return root


def fake_v1(tmp_path):
    """v1's cpu, memory and pids trees, without the devices controller."""
    root = tmp_path / "v1"
    for c in rank_cgroup.V1_CONTROLLERS:
        (root / c).mkdir(parents=True)
        (root / c / "cgroup.procs").write_text("")
    return root


def test_cgroup_v2_limits_and_controllers_down_to_the_parent(tmp_path):
    root = fake_v2(tmp_path)
    cg = rank_cgroup.RankCgroup.create(root, "gpufleet/node-1", "lease-1", cpus=2.5, memory_bytes=3 * GIB, pids=500)
    d = root / "gpufleet" / "node-1" / "lease-1"
    assert cg.version == 2 and cg.dirs == [d]
    assert (root / "cgroup.subtree_control").read_text() == "+pids"  # only what was missing
    for level in (root / "gpufleet", root / "gpufleet" / "node-1"):
        assert (level / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    assert (d / "cpu.max").read_text() == "250000 100000"
    assert (d / "memory.max").read_text() == str(3 * GIB) and (d / "pids.max").read_text() == "500"
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 2\noom_kill 2\n")
    assert cg.oom_kills() == 2
    assert rank_cgroup.RankCgroup.from_json(cg.as_json()).dirs == [d]


def test_a_root_without_the_controllers_is_refused(tmp_path):
    root = fake_v2(tmp_path)
    (root / "cgroup.controllers").write_text("cpu io\n")
    with pytest.raises(rank_cgroup.CgroupError, match="memory, pids"):
        rank_cgroup.hierarchy(root)
    with pytest.raises(rank_cgroup.CgroupError, match="no v1"):
        rank_cgroup.hierarchy(tmp_path / "empty")


@pytest.mark.skipif(os.geteuid() != 0, reason="an agent asked for cgroups must be root")
async def test_an_agent_that_cannot_fence_gpus_says_so_and_sends_no_device_list(tmp_path, caplog):
    """Where cgroup v2 takes no device program (here: a stand-in tree, not a cgroup), the
    agent still fences CPUs, memory and processes; it says at start that GPUs are not
    fenced rather than start ranks that believe they are, and leaves no probe behind."""
    root = fake_v2(tmp_path)
    settings = make_settings(tmp_path, agent_rank_cgroups=True, agent_cgroup_root=root)
    node = NodeAgent(settings, "node-v2", backend=make_backend(settings, "node-v2", "simulated"))
    await node.start()
    try:
        assert not node.gpu_fence
        assert f"a rank's GPUs are not fenced: cgroup v2 at {root} takes no BPF device program" in caplog.text
        assert not (root / settings.agent_cgroup_parent / "node-v2" / rank_cgroup.PROBE).exists()
    finally:
        await close_node(node)


def test_the_v2_probe_takes_the_steps_a_ranks_cgroup_takes(tmp_path, monkeypatch):
    """The probe attaches a program to a cgroup beside the ranks' and removes it; the v1
    answer is whether the devices controller is mounted."""
    root = fake_v2(tmp_path)
    attached = []
    monkeypatch.setattr(rank_cgroup.device_bpf, "deny", lambda d, denied: attached.append((d, list(denied))))
    assert rank_cgroup.device_fence_problem(root, "gpufleet/node-1") is None
    assert attached == [(root / "gpufleet" / "node-1" / rank_cgroup.PROBE, [])]
    assert not attached[0][0].exists()
    v1 = fake_v1(tmp_path)
    assert rank_cgroup.device_fence_problem(v1, "gpufleet/node-1") == "no cgroup v1 devices controller"
    (v1 / "devices").mkdir()
    (v1 / "devices" / "devices.deny").write_text("")
    assert rank_cgroup.device_fence_problem(v1, "gpufleet/node-1") is None


def test_cgroup_v2_denies_devices_with_a_program_on_the_ranks_cgroup(tmp_path, monkeypatch):
    """The list goes to the rank's own cgroup before its processes join it (the kernel's
    verdicts on such a program: tests/security/test_device_fence_v2.py)."""
    root = fake_v2(tmp_path)
    attached = []
    monkeypatch.setattr(rank_cgroup.device_bpf, "deny", lambda d, denied: attached.append((d, list(denied))))
    cg = rank_cgroup.RankCgroup.create(
        root, "gpufleet/node-1", "lease-1", cpus=1, memory_bytes=GIB, pids=10, deny_devices=[(195, 0), (195, 2)]
    )
    assert attached == [(root / "gpufleet" / "node-1" / "lease-1", [(195, 0), (195, 2)])]
    assert cg.dirs == [attached[0][0]]


def test_a_cgroup_that_takes_no_device_program_refuses_the_list_rather_than_ignore_it(tmp_path):
    root = fake_v2(tmp_path)  # a stand-in dir is no cgroup: the kernel refuses the program
    with pytest.raises(rank_cgroup.CgroupError, match=r"cannot deny devices \[\(195, 1\)\]"):
        rank_cgroup.RankCgroup.create(
            root, "gpufleet/node-1", "lease-1", cpus=1, memory_bytes=GIB, pids=10, deny_devices=[(195, 1)]
        )
    v1 = fake_v1(tmp_path)
    with pytest.raises(rank_cgroup.CgroupError, match="no cgroup v1 devices controller"):
        rank_cgroup.RankCgroup.create(
            v1, "gpufleet/node-1", "lease-1", cpus=1, memory_bytes=GIB, pids=10, deny_devices=[(195, 1)]
        )


@pytest.mark.skipif(os.geteuid() != 0, reason="making device nodes needs root")
def test_the_gpu_nodes_a_rank_may_not_open(tmp_path):
    """Every nvidiaN character device but the rank's own GPUs', matched by minor number; the
    control nodes and anything that is not a character device are not GPUs."""
    dev = tmp_path / "dev"
    dev.mkdir()
    for name, minor in (("nvidia0", 0), ("nvidia1", 1), ("nvidia7", 7), ("nvidiactl", 255), ("nvidia-modeset", 254)):
        os.mknod(dev / name, 0o666 | stat.S_IFCHR, os.makedev(195, minor))
    (dev / "nvidia3").write_text("a file, not a GPU")
    (dev / "nvidia4").symlink_to(dev / "nvidia0")
    nodes = gpu_devices.gpu_device_numbers(dev)
    assert nodes == {0: (195, 0), 1: (195, 1), 7: (195, 7)}
    assert gpu_devices.denied_devices(nodes, [7]) == [(195, 0), (195, 1)]
    assert gpu_devices.denied_devices(nodes, [0, 1, 7]) == []
    assert gpu_devices.gpu_device_numbers(tmp_path / "none") == {}


# --- disk: the work dir's share, measured by the rank's supervisor -----------------------------


def test_the_disk_share_is_the_work_dirs_filesystem_less_its_reserve():
    got = rank_limits(
        gpus=1, node_gpus=8, node_cpus=96, node_memory_bytes=1024 * GIB, reserved_cpus=2,
        reserved_memory_bytes=8 * GIB, pids_max=4096, node_disk_bytes=3584 * GIB, reserved_disk_bytes=100 * GIB,
    )  # fmt: skip
    assert got.disk_bytes == 3484 * GIB // 8
    small = rank_limits(gpus=8, node_gpus=8, node_cpus=2, node_memory_bytes=GIB, reserved_cpus=0,
                        reserved_memory_bytes=0, pids_max=64, node_disk_bytes=60 * GIB,
                        reserved_disk_bytes=100 * GIB)  # fmt: skip
    assert small.disk_bytes == 30 * GIB  # the reserve takes at most half


def test_dir_bytes_counts_blocks_once_and_follows_no_link(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a").write_bytes(b"x" * (2 * MIB))
    os.link(tmp_path / "sub" / "a", tmp_path / "a-again")  # a hard link is the same blocks
    os.symlink("/usr", tmp_path / "usr")  # not followed
    with open(tmp_path / "sparse", "wb") as f:
        f.truncate(1 << 30)  # a 1-GiB hole holds nothing
    used = dir_bytes(tmp_path)
    assert 2 * MIB <= used < 2 * MIB + 64 * 1024
    assert dir_bytes(tmp_path, stop_above=MIB) > MIB  # known to be past it, early


async def test_a_rank_past_its_disk_share_is_ended_and_says_why(tmp_path):
    # 64 MiB for the node's work dirs, nothing reserved: one GPU of eight may hold 8 MiB
    settings = make_settings(tmp_path, agent_node_disk_gib=0.0625, agent_node_reserved_disk_gib=0,
                             agent_rank_disk_check_s=0.1)  # fmt: skip
    node = NodeAgent(settings, "node-d", backend=make_backend(settings, "node-d", "simulated"))
    await node.start()
    try:
        hog = "head -c 20971520 /dev/zero > big; echo wrote; sleep 60"
        small = "head -c 1048576 /dev/zero > small; sleep 0.5; echo done"
        for lease, body, gpu in (("lease-hog", hog, 0), ("lease-small", small, 1)):
            res = await node.start_task(start_task("node-d", lease, ["/bin/sh", "-c", body], gpus=(gpu,)))
            assert res.accepted, res
        for lease in ("lease-hog", "lease-small"):
            await wait_for(lambda lease=lease: not node.leases[lease].live, timeout=20, what=f"{lease} to end")
        hog_st, small_st = node.leases["lease-hog"], node.leases["lease-small"]
        assert hog_st.exit["state"] == "EXITED" and hog_st.exit["exit_code"] != 0  # a failure, not a preemption
        assert hog_st.exit["disk_exceeded"]["limit_bytes"] == 8 * MIB
        assert hog_st.exit["disk_exceeded"]["used_bytes"] > 8 * MIB
        assert "more than its disk share of 0.01 GiB" in exit_cause.stderr_tail(hog_st.dir / sf.STDERR)
        assert small_st.exit["exit_code"] == 0 and "disk_exceeded" not in small_st.exit
        spec = sf.read_json(small_st.dir / sf.SPEC)
        assert spec["env"]["GPUFLEET_DISK_BYTES"] == str(8 * MIB)
    finally:
        await close_node(node)
