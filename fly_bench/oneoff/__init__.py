"""One-off measurements, each a module run as `python -m fly_bench.oneoff.<name>`: a question
asked once and answered in docs/journal.md or the README, kept so that the figure can be
measured again. They time through fly_bench.timing and take their prompts from fly_bench.prompts;
nothing here is asserted, and nothing outside imports it."""
