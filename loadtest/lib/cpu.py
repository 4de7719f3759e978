#!/usr/bin/env python3
"""CPU seconds used so far by each part of a benchmark, as one JSON object.

    cpu.py gateway=PID demo=PID redis=PID nginx=PID,PID ...

Each name gets the user+system time of its PIDs (and of their reaped children);
`postgres` is added for every process owned by the postgres user (the postmaster's
reaped backends included), and `machine` is the busy time of the whole machine, so
whatever no name accounts for (the load generator, mostly) is machine minus the rest.
"""
import json
import os
import pwd
import sys

TICK = os.sysconf("SC_CLK_TCK")


def pid_seconds(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return 0.0
    # fields[0] is the state (field 3); utime, stime, cutime, cstime are fields 14-17.
    return sum(int(x) for x in fields[11:15]) / TICK


def postgres_seconds():
    try:
        uid = pwd.getpwnam("postgres").pw_uid
    except KeyError:
        return 0.0
    total = 0.0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    total += pid_seconds(pid)
            except FileNotFoundError:
                pass
    return total


def machine_seconds():
    with open("/proc/stat") as f:
        cpu = [int(x) for x in f.readline().split()[1:]]
    idle = cpu[3] + cpu[4]  # idle + iowait
    return (sum(cpu[:8]) - idle) / TICK


out = {}
for arg in sys.argv[1:]:
    name, pids = arg.split("=", 1)
    out[name] = sum(pid_seconds(p) for p in pids.split(",") if p and p != "0")
out["postgres"] = postgres_seconds()
out["machine"] = machine_seconds()
print(json.dumps(out))
