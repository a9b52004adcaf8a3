"""The embedded multi-turn tasks (--environment lookup, lookup_scored): the embedded copy task with
the string hidden until the model asks for it, so one turn cannot solve it and two can; the
scored variant rewards itself (get_reward) instead of through task_reward."""

import dataclasses


@dataclasses.dataclass
class LookupEnvironment:
    """The embedded task with the string hidden: the prompt is "=" only, and the string is shown
    ("4172=") only in answer to the model's first turn (its question, whatever it says), to be
    copied in the second. One turn can only guess the digits (reward about 0.05)."""
    target: str
    asked: bool = False

    def reset(self):
        return "="

    def step(self, text):
        if self.asked:
            return None, True
        self.asked = True
        return self.target + "=", False


def lookup_environment(row):
    return LookupEnvironment(row["target"])


@dataclasses.dataclass
class ScoredLookup(LookupEnvironment):
    """The lookup task scoring itself (get_reward; docs/multi-turn.md 'Multi-turn: tools and
    environments'): task_reward's per-position credit for the model's answer, the turn after the
    string was shown."""
    answer: str = ""

    def step(self, text):
        if self.asked:
            self.answer = text
        return super().step(text)

    def get_reward(self):
        got, want = self.answer, self.target
        return sum(a == b for a, b in zip(got, want)) / max(len(got), len(want), 1)
