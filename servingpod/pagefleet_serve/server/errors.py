"""Errors as OpenAI's JSON: {"error": {"message", "type", "param", "code"}}.

Every failure a client can see goes through `APIError`, so the shape is the same for a bad
field, a full queue or an engine failure, and no stack trace ever reaches a response.
"""

from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def server_error(message: str) -> APIError:
    return APIError(500, message, type="server_error")


def unavailable(message: str, code: str) -> APIError:
    return APIError(503, message, type="service_unavailable", code=code)
