"""This process's memory mappings and the kernel's limit on them (Linux; 0 where unreadable)."""

from pathlib import Path

try:
    MAP_LIMIT = int(Path("/proc/sys/vm/max_map_count").read_text())
except OSError:
    MAP_LIMIT = 0


def memory_mappings() -> int:
    with open("/proc/self/maps", "rb") as f:
        return sum(1 for _ in f)
