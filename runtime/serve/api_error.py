"""OpenAI's error object: what every refusal of the server is, with the status it deserves and
the parameter it names."""

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
               503: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)
