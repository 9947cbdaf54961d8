"""TokenSwift Studio application: the Gradio UI, the background generation worker and what they share."""
