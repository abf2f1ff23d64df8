"""The progress of long jobs (sharding, HellaSwag, conversions), on stderr: a bar on a terminal,
plain lines in a log."""
import sys
import time

from tqdm import tqdm

# Seconds between plain progress lines: a log (nohup, SLURM) shows that a job of hours lives,
# without a line a second.
PROGRESS_EVERY = 60


def progress_meter(desc, unit, total=None, initial=0, scale=False, disable=False):
    """The progress of a long job, on stderr: tqdm's bar where stderr is a terminal, else a plain
    line every PROGRESS_EVERY seconds (ProgressLines). Both take update(n), set_postfix(**values)
    and close(). total: None where unknown (no time left is shown); scale: 1.2M rather than 1,200,000."""
    if disable or sys.stderr.isatty():
        return tqdm(total=total, unit=unit, desc=desc, initial=initial, unit_scale=scale, disable=disable)
    return ProgressLines(desc, unit, total, initial, scale)


class ProgressLines:
    """progress_meter() where no terminal shows a bar: lines such as
    `hellaswag: 2,400/10,042 ex (24%), 41.3 ex/s, 03:05 left, acc_norm=0.2950`."""

    def __init__(self, desc, unit, total, initial, scale):
        self.desc, self.unit, self.total, self.scale = desc, unit, total, scale
        self.start, self.done = initial, initial
        self.postfix = {}
        self.t0 = self.last = time.monotonic()

    def update(self, n=1):
        self.done += n
        if time.monotonic() - self.last >= PROGRESS_EVERY:
            self.write()

    def set_postfix(self, refresh=True, **values):
        self.postfix = values

    def close(self):
        if self.last != self.t0:  # the log ends at where the job ended, once it has shown any line
            self.write()

    def write(self):
        self.last = time.monotonic()
        rate = (self.done - self.start) / max(self.last - self.t0, 1e-9)
        count = self.number(self.done)
        if self.total:
            count += f"/{self.number(self.total)} {self.unit} ({100 * self.done / self.total:.0f}%)"
        else:
            count += f" {self.unit}"
        parts = [count, f"{self.number(rate)} {self.unit}/s"]
        if self.total and self.done < self.total and rate > 0:
            parts.append(f"{tqdm.format_interval((self.total - self.done) / rate)} left")
        parts += [f"{key}={value}" for key, value in self.postfix.items()]
        print(f"{self.desc}: {', '.join(parts)}", file=sys.stderr, flush=True)

    def number(self, x):
        return tqdm.format_sizeof(x) if self.scale else f"{x:,.0f}" if x >= 100 else f"{x:,.1f}".removesuffix(".0")
