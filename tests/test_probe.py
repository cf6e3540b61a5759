import os
import platform
from importlib import metadata
from pathlib import Path

import psutil
from edge.offload.probe import probe_machine


def test_probe_reports_the_machine() -> None:
    """Each figure is the one the OS and the installed packages give (psutil, platform, /proc/cpuinfo's model name)."""
    machine = probe_machine()
    assert set(machine) == {"cpu", "cores", "ram_total_gb", "ram_free_gb", "memory_limit", "gpus", "platform",
                            "python", "llama_cpp_python"}
    assert machine["cores"] == os.cpu_count()
    if machine["memory_limit"] is None:  # no memory cgroup limit over this process: the machine's RAM
        assert abs(machine["ram_total_gb"] - psutil.virtual_memory().total / 2**30) < 0.01
    else:
        assert machine["ram_total_gb"] <= psutil.virtual_memory().total / 2**30 + 0.01
    assert 0 < machine["ram_free_gb"] <= machine["ram_total_gb"]
    assert (machine["platform"], machine["python"]) == (platform.platform(), platform.python_version())
    assert machine["llama_cpp_python"] == metadata.version("llama-cpp-python")
    cpuinfo = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace").splitlines()
    names = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
    assert machine["cpu"] == (names[0] if names else platform.processor() or platform.machine())
    assert isinstance(machine["gpus"], list)


def _cgroups(tmp_path: Path, memberships: str, mounts: list[str], files: dict[str, str]) -> Path:
    """A fake /proc/self (cgroup, mountinfo) and cgroup folders under tmp_path; returns the fake /proc/self."""
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(memberships)
    (proc / "mountinfo").write_text("\n".join(line.replace("ROOT", str(tmp_path)) for line in mounts) + "\n")
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return proc


def test_a_cgroup_v2_limit_is_the_tightest_of_the_cgroup_and_its_parents(tmp_path: Path) -> None:
    from edge.offload.probe import memory_limit

    proc = _cgroups(tmp_path, "0::/user.slice/app.scope\n", [
        "30 23 0:26 / ROOT/cg rw,nosuid - cgroup2 cgroup2 rw",
    ], {
        "cg/user.slice/app.scope/memory.max": "max\n",
        "cg/user.slice/app.scope/memory.current": "100\n",
        "cg/user.slice/app.scope/memory.stat": "anon 60\nfile 40\n",
        "cg/user.slice/memory.max": str(700 << 20) + "\n",
        "cg/user.slice/memory.current": str(300 << 20) + "\n",
        "cg/user.slice/memory.stat": f"anon {200 << 20}\nfile {100 << 20}\n",
    })
    limit = memory_limit(proc)
    assert limit is not None and limit.limit == 700 << 20 and limit.unreclaimable == 200 << 20
    assert limit.source.endswith("cg/user.slice/memory.max")


def test_a_cgroup_v1_limit_in_a_container_reads_the_mount_itself(tmp_path: Path) -> None:
    """A container sees its own cgroup mounted as the root, while /proc/self/cgroup names the host's path: the
    mount point's files are the container's."""
    from edge.offload.probe import NO_LIMIT, memory_limit

    proc = _cgroups(tmp_path, "5:cpu:/\n4:memory:/docker/abc123\n0::/\n", [
        "31 23 0:28 / ROOT/fs rw - tmpfs tmpfs rw",
        "35 31 0:32 /docker/abc123 ROOT/mem rw,relatime - cgroup cgroup rw,memory",
    ], {
        "mem/memory.limit_in_bytes": str(1100 << 20) + "\n",
        "mem/memory.usage_in_bytes": str(500 << 20) + "\n",
        "mem/memory.stat": f"cache {400 << 20}\nrss {100 << 20}\ntotal_cache {400 << 20}\n",
    })
    limit = memory_limit(proc)
    assert limit is not None and (limit.limit, limit.unreclaimable) == (1100 << 20, 100 << 20)
    (tmp_path / "mem/memory.limit_in_bytes").write_text(str(NO_LIMIT + 4096))  # v1's "no limit"
    assert memory_limit(proc) is None


def test_no_cgroup_files_means_no_limit(tmp_path: Path) -> None:
    from edge.offload.probe import memory_limit

    assert memory_limit(tmp_path / "nowhere") is None
    proc = _cgroups(tmp_path, "0::/\n", ["30 23 0:26 / ROOT/cg rw - cgroup2 cgroup2 rw"], {})
    assert memory_limit(proc) is None  # mounted, but no memory controller's files
