#!/usr/bin/env python3
"""The LokaDB Django test application (tests/tests/it/django.rs runs it)."""
import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lokanotes.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
