"""Tasks: prompt sources with verifiable rewards, looked up by name (rl/tasks/registry.py)."""

from rl.tasks.registry import TASKS, Task, get_task, register_task

__all__ = ["TASKS", "Task", "get_task", "register_task"]
