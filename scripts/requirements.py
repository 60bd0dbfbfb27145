#!/usr/bin/env python3
"""Print the pinned requirements from setup.cfg, one per line.

setup.cfg is the one place that pins them; the Makefile's venv and the zipapp
build (scripts/build_pyz.py) both read them from here.

    requirements.py            install_requires
    requirements.py test       install_requires + the test extra
"""
import configparser
import pathlib
import sys


def requirements(extras: tuple[str, ...] | list[str] = ()) -> list[str]:
    cfg = configparser.ConfigParser()
    cfg.read(pathlib.Path(__file__).resolve().parent.parent / "setup.cfg")
    lines = cfg["options"]["install_requires"].strip().splitlines()
    for extra in extras:
        lines += cfg["options.extras_require"][extra].strip().splitlines()
    return [line.strip() for line in lines if line.strip()]


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1:])))
