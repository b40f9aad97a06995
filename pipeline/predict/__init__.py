"""What a step will cost before it runs: probed chunks, calibrated hops, contention, simulated schedule."""
