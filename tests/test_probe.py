import os
import platform
from importlib import metadata
from pathlib import Path

import psutil
from edge.offload.probe import probe_machine


def test_probe_reports_the_machine() -> None:
    """Each figure is the one the OS and the installed packages give (psutil, platform, /proc/cpuinfo's model name)."""
    machine = probe_machine()
    assert set(machine) == {"cpu", "cores", "ram_total_gb", "ram_free_gb", "gpus", "platform", "python",
                            "llama_cpp_python"}
    assert machine["cores"] == os.cpu_count()
    assert abs(machine["ram_total_gb"] - psutil.virtual_memory().total / 2**30) < 0.01
    assert 0 < machine["ram_free_gb"] <= machine["ram_total_gb"]
    assert (machine["platform"], machine["python"]) == (platform.platform(), platform.python_version())
    assert machine["llama_cpp_python"] == metadata.version("llama-cpp-python")
    cpuinfo = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace").splitlines()
    names = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
    assert machine["cpu"] == (names[0] if names else platform.processor() or platform.machine())
    assert isinstance(machine["gpus"], list)
