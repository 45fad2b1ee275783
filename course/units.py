"""The course's units, in order: what course/make.py cuts from the reference code and course/grade.py checks.

Each unit names the file it lives in and the functions a student writes ("Class.method" for a method); a lab
has no functions of its own and names the units it runs on. The handout of unit N is course/unitN-NAME.md.
"""

UNITS = [
    dict(n=1, name="envs", file="envs.py", funcs=["_push", "sokoban_bfs", "SokobanEnv._apply"],
         title="an environment's step and its BFS expert (section 3.1)"),
    dict(n=2, name="rollout", file="rollout.py", funcs=["parse_reply", "trained_mask", "Segment.append"],
         title="the reply parser and the loss mask from recorded positions (section 2.1, Figure 2)"),
    dict(n=3, name="advantages", file="advantages.py", funcs=["grpo_advantages", "gae"],
         title="GRPO's group normalisation, Dr.GRPO's switch, and GAE (section 2.2, Appendix A)"),
    dict(n=4, name="loss", file="starpo.py", funcs=["aggregate", "policy_loss", "kl_penalty"],
         title="the token-level clipped loss, Clip-Higher, the KL term, the aggregation (sections 2.2, 4.2)"),
    dict(n=5, name="filter", file="filter.py", funcs=["select_groups"],
         title="StarPO-S's variance filter (section 4.2)"),
    dict(n=6, name="echo-trap", lab=True, needs=[2, 3, 4, 5],
         title="lab: the Echo Trap with your own code (section 4.1)"),
    dict(n=7, name="sft", lab=True, needs=[1, 2, 3, 4, 5],
         title="lab, optional: expert SFT against RL (Appendix G)"),
]
BY_NUMBER = {u["n"]: u for u in UNITS}


def handout(unit: dict) -> str:
    return f"course/unit{unit['n']}-{unit['name']}.md"


def stub_message(unit: dict, func: str) -> str:
    """What a stub raises; engine/cli.py prints a NotImplementedError that starts with "unit " as one line."""
    return f"unit {unit['n']} ({unit['name']}): implement {func} -- see {handout(unit)}"
