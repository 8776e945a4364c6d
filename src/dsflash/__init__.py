"""dsflash: serve DeepSeek-V4.1-Flash from a bfp4 expert store through a device slot LRU."""

__version__ = "0.1.0"
