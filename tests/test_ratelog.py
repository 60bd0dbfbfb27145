"""ondemand/ratelog.py: a log line at most once a minute (``OnceAMinute``), on a clock the test
moves by hand: the first line is due at once, those within the minute are kept quiet and
counted, and the next line says how many."""
from ondemand.ratelog import OnceAMinute


def test_a_line_at_most_every_period_saying_how_many_were_kept_quiet():
    now = [1000.0]
    once = OnceAMinute(clock=lambda: now[0])
    assert once.due() == ""  # the first: at once, nothing to add
    for step in (1.0, 30.0, 28.9):  # 59.9 s after it: still quiet
        now[0] += step
        assert once.due() is None
    assert once.suppressed == 3
    now[0] += 0.1  # a minute after the last line
    assert once.due() == " (3 more since the last such line)" and once.suppressed == 0
    now[0] += 60.0  # nothing kept quiet since: nothing to add
    assert once.due() == ""


def test_the_period_counts_from_the_last_line_not_the_last_call():
    now = [0.0]
    once = OnceAMinute(every_s=10.0, clock=lambda: now[0])
    lines = []
    for t in range(0, 45, 3):  # a call every 3 s: a line every 12 s (the first call 10 s after a line)
        now[0] = float(t)
        if once.due() is not None:
            lines.append(t)
    assert lines == [0, 12, 24, 36]
