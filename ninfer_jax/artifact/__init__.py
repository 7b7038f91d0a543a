"""Model packages on disk: HF checkpoint reading, the artifact format, conversion."""
