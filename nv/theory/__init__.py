"""Theory and the baseline (§4.1.2, §5.2, App. F). ``sample_complexity``: Theorem 1 and Corollary 1
(expected and 95 % samples per prompt N for a common set of size d, mu(N) and its inversion) and the
empirical N of the pruned common set; ``carlini``: the top-1 logit-bias attack of Carlini et al.,
its cost d|V|(l_sys + 2), and NightVision's cost overhead against it."""
