"""The S3 backend as a package; the module is moved here whole first, split by concern next."""

from .store import MultipartUpload, S3Options, S3Storage, map_s3_error

__all__ = ["MultipartUpload", "S3Options", "S3Storage", "map_s3_error"]
