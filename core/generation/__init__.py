"""Generation: sampling, the decode loop (vanilla decoding, and any step function plugged into it), text in and
out, and the text's quality figures."""
