"""TokenSwift: drafting heads, the n-gram table, the candidate tree, draft calibration and the draft-verify step,
plugged into the generation layer's decode loop."""
