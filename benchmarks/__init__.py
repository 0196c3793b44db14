"""The `make bench*` measurements, apart from the library they measure (nothing in `sinkstudy`, `evals`,
`interventions` or `experiments` imports them, so editing one changes no result's key): `sink_pass` (`make bench`),
`generate` (`make bench-eval`), `extract` (`make bench-extract`), `adapt_loss` and `adapt_overhead`
(`make bench-adapt`), `numerics` (`make bench-numerics`), `threads` (`make bench-threads`). Each runs as
`python -m benchmarks.NAME`."""
