//! TLS for the gateway's public port and the worker's outbound link (rustls with the ring
//! provider): a certificate from PEM files, or a self-signed one for dev, and a client that
//! trusts either the web's roots or one given CA.

use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore, ServerConfig};

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .with_context(|| format!("reading PEM certificates from {}", path.display()))?;
    if certs.is_empty() {
        bail!("{} holds no PEM certificate", path.display());
    }
    Ok(certs)
}

fn server(
    certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<Arc<ServerConfig>> {
    let config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .context("certificate and key do not form a usable TLS identity")?;
    Ok(Arc::new(config))
}

/// A server identity from PEM files.
pub fn server_from_files(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>> {
    let key = PrivateKeyDer::from_pem_file(key)
        .with_context(|| format!("reading a PEM private key from {}", key.display()))?;
    server(read_certs(cert)?, key)
}

/// A fresh self-signed identity for `localhost` and 127.0.0.1; its certificate is written
/// to `cert_out` so that clients can pass it as their CA.
pub fn self_signed(cert_out: &Path) -> Result<Arc<ServerConfig>> {
    let names = vec!["localhost".to_string(), "127.0.0.1".to_string()];
    let certified =
        rcgen::generate_simple_self_signed(names).context("generating a certificate")?;
    std::fs::write(cert_out, certified.cert.pem())
        .with_context(|| format!("writing {}", cert_out.display()))?;
    let key = PrivateKeyDer::Pkcs8(certified.signing_key.serialize_der().into());
    server(vec![certified.cert.der().clone()], key)
}

/// A client trusting `ca` when given (a dev gateway's self-signed certificate), else the
/// web's usual roots.
pub fn client(ca: Option<&Path>) -> Result<Arc<ClientConfig>> {
    let mut roots = RootCertStore::empty();
    match ca {
        Some(path) => {
            for cert in read_certs(path)? {
                roots.add(cert).with_context(|| {
                    format!("{} is not a usable CA certificate", path.display())
                })?;
            }
        }
        None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
    }
    let config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pem_certificate_and_key_load() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
        let certified = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        std::fs::write(&cert, certified.cert.pem()).unwrap();
        std::fs::write(&key, certified.signing_key.serialize_pem()).unwrap();
        server_from_files(&cert, &key).unwrap();
        client(Some(&cert)).unwrap();
    }

    #[test]
    fn garbage_and_missing_files_are_one_line_errors() {
        let dir = tempfile::tempdir().unwrap();
        let garbage = dir.path().join("garbage.pem");
        std::fs::write(&garbage, b"not a certificate\n\x00\xff-----BEGIN\n").unwrap();
        let truncated = dir.path().join("truncated.pem");
        std::fs::write(&truncated, "-----BEGIN CERTIFICATE-----\nMIIB\n").unwrap();
        let missing = dir.path().join("missing.pem");
        for path in [&garbage, &truncated, &missing] {
            for error in [
                server_from_files(path, path).unwrap_err(),
                client(Some(path)).unwrap_err(),
            ] {
                let line = format!("{error:#}");
                assert!(!line.contains('\n'), "{line}");
                assert!(line.contains(&*path.to_string_lossy()), "{line}");
            }
        }
    }
}
