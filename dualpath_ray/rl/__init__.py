"""An RL loop on DualPath: the GRPO job's task, trainer, agent and reports (jobs/grpo_tool_agent.py)."""
