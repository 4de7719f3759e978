//! The OpenAPI 3.1 document of idemgate's own APIs, generated from their handlers: the
//! tenant's lookup (`/_idemgate/v1/keys`, on `server.listen`, a tenant's token) and the
//! operator's admin API (`/admin/v1`, on `admin.listen`, the admin token). Served at
//! `GET /admin/v1/openapi.json`.

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use axum::Json;
use axum::response::{IntoResponse, Response};

use crate::listing::ProblemDoc;
use crate::{admin, lookup, operator};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "idemgate",
        description = "The tenant's key lookup (on `server.listen`, with the tenant's own token) and the operator's admin API (on `admin.listen`, with the bearer token of `admin.token_file`).",
    ),
    paths(
        lookup::show,
        lookup::result,
        lookup::list,
        admin::show,
        admin::list,
        admin::held,
        admin::release,
        serve,
    ),
    components(schemas(
        ProblemDoc,
        lookup::TenantKey,
        lookup::TenantKeyPage,
        operator::OperatorKey,
        admin::OperatorKeyPage,
        admin::HeldKeys,
        admin::ReleaseRequest,
        admin::Released,
    )),
    modifiers(&Bearers),
    tags(
        (name = "lookup", description = "A tenant's own keys, never their bodies"),
        (name = "admin", description = "Operators: show, list and release keys (docs/operations.md rules)"),
    ),
)]
struct Document;

/// The two bearer schemes: a tenant's JWT, and the admin token.
struct Bearers;

impl Modify for Bearers {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "tenant_token",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .bearer_format("JWT")
                    .build(),
            ),
        );
        components.add_security_scheme(
            "admin_token",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The document.
pub fn document() -> utoipa::openapi::OpenApi {
    let mut doc = Document::openapi();
    doc.info.version = env!("CARGO_PKG_VERSION").to_owned();
    doc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_document_is_openapi_3_1_and_names_every_path() {
        let doc = serde_json::to_value(document()).unwrap();
        assert_eq!(doc["openapi"], "3.1.0");
        let paths = doc["paths"].as_object().unwrap();
        for path in [
            "/_idemgate/v1/keys",
            "/_idemgate/v1/keys/{key}",
            "/admin/v1/tenants/{tenant}/keys",
            "/admin/v1/tenants/{tenant}/keys/{key}",
            "/admin/v1/tenants/{tenant}/keys/{key}/release",
            "/admin/v1/held",
            "/admin/v1/openapi.json",
        ] {
            assert!(
                paths.contains_key(path),
                "{path} missing: {:?}",
                paths.keys()
            );
        }
    }
}

/// `GET /admin/v1/openapi.json`, behind the admin token.
#[utoipa::path(
    get,
    path = "/admin/v1/openapi.json",
    tag = "admin",
    security(("admin_token" = [])),
    responses(
        (status = 200, description = "This document (OpenAPI 3.1)", content_type = "application/json"),
        (status = 401, description = "Not the admin token", body = ProblemDoc, content_type = "application/problem+json"),
    ),
)]
pub async fn serve() -> Response {
    Json(document()).into_response()
}
