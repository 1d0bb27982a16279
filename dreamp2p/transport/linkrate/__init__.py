"""A link's rate: measured (`linkstats`), paced for WAN emulation (`limiter`), and checked against what the
kernel's TCP settings allow (`tcptuning`, `kernelnet`)."""
